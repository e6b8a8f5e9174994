"""cuBLAS's workspaces in the theory's GPU peak: read from the device's measurement
(benchmarks/gpu_workspace_<device>.json, written by benchmarks/gpu_workspace.py on a GPU), and where
no file exists, not a term at all and said to be missing. No GPU has measured them yet: today's
profiles must say so; a measurement, written here as the script writes it, enters the peak."""

from __future__ import annotations

import dataclasses
import json

import pytest

from labkit import ConfigError, ParallelConfig, theory
from labkit.theory.planner import calibration, hardware
from labkit.theory.planner.hardware import H100, H200
from labkit.theory.presets import LLAMA31_8B

CFG = ParallelConfig(dp=8, global_batch=16, precision="bf16", sharding="fsdp")
MEASURED = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-30", "torch": "2.11.0", "cuda": "13.0"}


def test_not_measured_is_no_term_and_an_assumption(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "BENCHMARKS", str(tmp_path))  # a checkout where no GPU measured them
    assert calibration.load_workspace("h100") is None
    fields, unmeasured = hardware.workspaces("h100")
    assert fields == {} and len(unmeasured) == 1 and "cuBLAS's workspaces: not measured on the h100" in unmeasured[0]
    plan = theory.evaluate(CFG, LLAMA31_8B, dataclasses.replace(H100, workspace=None))
    assert "workspaces" not in plan.memory
    # the peak is the sum of the terms that exist, nothing stands in for the missing one
    m = plan.memory
    assert m["peak"] == pytest.approx(m["reserved"] + m["cuda_context"] + m["nccl"])


def test_the_profiles_say_what_the_checkout_holds():
    for device, hw in (("h100", H100), ("h200", H200)):
        kept = calibration.load_workspace(device)
        assert hw.workspace == (None if kept is None else float(kept[0])), hw.name
        said = any("cuBLAS's workspaces: not measured" in a for a in hw.assumptions)
        assert said == (kept is None), hw.name


def test_a_measurement_is_read_and_enters_the_peak(tmp_path, monkeypatch):
    w = 4 * 32 * 2**20
    (tmp_path / "gpu_workspace_h100.json").write_text(json.dumps({**MEASURED, "workspace_bytes": w}))
    monkeypatch.setattr(calibration, "BENCHMARKS", str(tmp_path))
    got, source = calibration.load_workspace("h100")
    assert got == w and "gpu_workspace_h100.json" in source and "torch 2.11.0" in source
    fields, unmeasured = hardware.workspaces("h100")
    assert fields == {"workspace": float(w)} and unmeasured == ()
    without = theory.evaluate(CFG, LLAMA31_8B, H100).memory
    with_it = theory.evaluate(CFG, LLAMA31_8B, dataclasses.replace(H100, workspace=float(w))).memory
    assert with_it["workspaces"] == w
    assert with_it["allocated"] == pytest.approx(without["allocated"] + w)
    assert with_it["required"] == pytest.approx(without["required"] + w)
    # the allocator's reserve is a fraction of the allocated bytes, workspaces included
    assert with_it["peak"] == pytest.approx(without["peak"] + w * (1 + H100.allocator))


def test_a_dry_runs_frame_is_not_a_measurement(tmp_path, monkeypatch):
    (tmp_path / "gpu_workspace_h200.json").write_text(json.dumps({"date": "2026-11-30", "dry_run": True}))
    monkeypatch.setattr(calibration, "BENCHMARKS", str(tmp_path))
    with pytest.raises(ConfigError, match="gpu_workspace_h200.json: 'workspace_bytes' must be a int"):
        calibration.load_workspace("h200")


@pytest.fixture(scope="module")
def bench(bench_script):
    return bench_script("gpu_workspace")


def test_the_constant_is_the_peak_the_workspaces_add(bench):
    one, mib = {"freed_by_clear": 32 * 2**20}, 2**20
    cases = {"one": one, "step": {"peak": 500 * mib, "freed_by_clear": 64 * mib}, "step, none": {"peak": 372 * mib}}
    got = bench.summary(cases)
    assert got["workspace_bytes"] == 128 * mib and got["workspaces_in_a_step"] == 4
    assert got["freed_by_clear_after_the_step"] == 64 * mib  # kept beside: this thread's only, here
    # a case that failed measures nothing: no constant
    assert bench.summary({**cases, "step, none": {"error": "CUDA error"}})["workspace_bytes"] is None
