"""Calibration apart from validation: the measurement files' schema and loader
(labkit/theory/planner/calibration.py), the H100 profile's constants read from
benchmarks/gpu_constants_h100.json by stated rules (not copied by hand), the allocator's reserve
from the H200's steps so that the H100's own steps stay validation rows, and the constants with no
source named in `labkit plan`."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from labkit import ConfigError
from labkit.cli import main
from labkit.theory.planner import calibration
from labkit.theory.planner.hardware import A100, H100, H100_GRAND_TETON, HALVING, HARDWARE, HEAD_DIM_64

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raw(device: str) -> dict:
    with open(os.path.join(ROOT, "benchmarks", f"gpu_constants_{device}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("device", ["h100", "h200"])
def test_every_measurement_file_holds_to_the_schema(device):
    m = calibration.load(device)
    for key in ("device", "driver", "torch", "cuda", "date"):
        assert m.data[key], (device, key)
    assert device.upper() in m.data["device"] and m.data["date"].startswith("2026-")


def test_the_schema_refuses_what_is_not_a_measurement():
    good = _raw("h100")
    assert calibration.problems(good) == []
    no_driver = {k: v for k, v in good.items() if k != "driver"}
    assert any("'driver' is missing" in p for p in calibration.problems(no_driver))
    assert any("'total_bytes'='85' must be a int" in p for p in calibration.problems(dict(good, total_bytes="85")))
    rows = [dict(good["matmul"][0])]
    del rows[0]["fp8_tflops"]
    assert any("matmul[0] lacks fp8_tflops" in p for p in calibration.problems(dict(good, matmul=rows)))
    assert calibration.problems([1, 2])


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "BENCHMARKS", str(tmp_path))
    with pytest.raises(ConfigError, match="gpu_constants_b200.json does not exist"):
        calibration.load("b200")
    (tmp_path / "gpu_constants_b200.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        calibration.load("b200")


def test_the_h100_constants_are_the_rules_applied_to_the_file():
    """Recomputed here from the JSON alone: a hand-copied constant would drift from these."""
    d, h200 = _raw("h100"), _raw("h200")
    large = [m for m in d["matmul"] if min(m["M"], m["K"], m["N"]) >= 4096]
    assert H100.matmul_eff == statistics.median(m["bf16_tflops"] for m in large) * 1e12 / 989e12
    assert H100.fp8_matmul_eff == statistics.median(m["fp8_tflops"] for m in large) * 1e12 / 1979e12
    long = [a for a in d["attention"] if a["hd"] == 128 and a["s"] >= 8192]
    assert H100.attention_eff == statistics.median(a["fwd_bwd_tflops"] for a in long) * 1e12 / 989e12
    short = statistics.median(a["fwd_bwd_tflops"] for a in d["attention"] if a["hd"] == 128 and a["s"] == 2048)
    assert HALVING == (1 - short / statistics.median(a["fwd_bwd_tflops"] for a in long)) / 2
    assert 0.7 < HEAD_DIM_64 < 0.8  # the one head-dim-64 row over head dim 128 at its keys
    assert H100.memory == d["total_bytes"] and H100.context == d["context_bytes"]
    assert abs(H100.hbm_eff - (d["bandwidth"]["copy_TBps"] + d["bandwidth"]["add_TBps"]) / 2 / 3.35) < 1e-12
    # the allocator from the H200's steps, not from the H100's (the rows benchmarks/published.py judges)
    mean = lambda steps: statistics.mean(s["reserved_peak"] / s["allocated_peak"] for s in steps) - 1  # noqa: E731
    assert H100.allocator == mean(h200["llama"]) and H100.allocator != mean(d["llama"])


def test_a_changed_measurement_changes_the_constant(tmp_path, monkeypatch):
    d = _raw("h100")
    d["matmul"] = [dict(m, bf16_tflops=m["bf16_tflops"] / 2) for m in d["matmul"]]
    (tmp_path / "gpu_constants_h100.json").write_text(json.dumps(d))
    monkeypatch.setattr(calibration, "BENCHMARKS", str(tmp_path))
    m = calibration.load("h100")
    halved = calibration.efficiencies(m, 989e12, 1979e12, 3.35e12, m)["matmul_eff"]
    assert abs(halved - H100.matmul_eff / 2) < 1e-12


def test_every_profile_names_its_assumptions_and_labkit_plan_prints_them(capsys):
    for hw in HARDWARE.values():
        assert hw.assumptions and all(a.strip() for a in hw.assumptions), hw.name
    assert len(H100_GRAND_TETON.assumptions) > len(H100.assumptions) and len(A100.assumptions) > len(H100.assumptions)
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--hardware", "h100-96gb", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "assumed (no measurement or datasheet): " in out and "midpoint of two datasheets" in out
    assert "nccl_channels 16" in out
