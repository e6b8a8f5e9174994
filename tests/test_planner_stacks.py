"""The software stack priced by name (labkit/theory/planner/stacks.py): eager PyTorch and
torch.compile run the same kernels at different paces, measured on an H200's profiled steps
(benchmarks/data/gpu-h200-2026-11-26/mfu.json), an input every run and evaluate/plan state."""

from __future__ import annotations

import json
import statistics

import pytest

from labkit import ConfigError, ParallelConfig, theory
from labkit.theory.planner import calibration, stacks
from labkit.theory.planner.hardware import H100
from labkit.theory.planner.published import RUNS
from labkit.theory.presets import LLAMA31_8B


def test_the_slowdowns_are_the_measured_kernels_over_the_priced_ones():
    rows = calibration.load_kernels()
    eager = [r for r in rows if r["what"] == "one eager"]
    assert len(eager) == 2 and {r["model"] for r in eager} == {"gpt2-124m", "llama3.2-1b"}
    memory, optimizer, source = stacks.slowdowns("eager")
    assert memory == statistics.median(r["kernels"]["kernel_s"]["other"] / stacks.priced(r)[0] for r in eager)
    assert optimizer == statistics.median(r["kernels"]["kernel_s"]["optimizer"] / stacks.priced(r)[1] for r in rows)
    assert "mfu.json" in source and "H200" in source
    # compile fuses the elementwise kernels: near the roofline, eager about twice it
    assert 1.0 < stacks.slowdowns("compile")[0] < 1.2 < 1.5 < memory < 2.5


def test_a_stack_is_refused_by_name_and_orders_the_steps():
    with pytest.raises(ConfigError, match="stack='jax' is not one of"):
        theory.evaluate(ParallelConfig(dp=8, global_batch=16, precision="bf16"), LLAMA31_8B, stack="jax")
    with pytest.raises(ConfigError, match="stack="):
        theory.plan(LLAMA31_8B, 8, stack="bogus")
    cfg = ParallelConfig(dp=8, global_batch=16, precision="bf16", sharding="fsdp")
    t = {s: theory.evaluate(cfg, LLAMA31_8B, "h100", stack=s).step_seconds for s in stacks.STACKS}
    assert t["roofline"] < t["compile"] < t["eager"]
    assert theory.evaluate(cfg, LLAMA31_8B, "h100", stack="compile").stack == "compile"
    # the device's own rates are untouched: only the stack's paces
    eager = stacks.with_stack(H100, "eager")
    assert eager.matmul_eff == H100.matmul_eff and eager.memory_slowdown > 1 == H100.memory_slowdown


def test_a_changed_measurement_changes_the_stack(tmp_path, monkeypatch):
    with open(calibration.KERNELS) as f:
        data = json.load(f)
    for r in data["rows"]:
        if "kernels" in r:
            r["kernels"]["kernel_s"]["other"] *= 2
    path = tmp_path / "mfu.json"
    path.write_text(json.dumps(data))
    before = stacks.slowdowns("eager")[0]
    monkeypatch.setattr(calibration, "KERNELS", str(path))
    monkeypatch.setattr(stacks, "load_kernels", lambda: calibration.load_kernels(str(path)))
    stacks.slowdowns.cache_clear()
    try:
        assert abs(stacks.slowdowns("eager")[0] - 2 * before) < 1e-9
    finally:
        stacks.slowdowns.cache_clear()


def test_a_broken_kernel_measurement_is_a_clear_error(tmp_path):
    path = tmp_path / "mfu.json"
    path.write_text(
        json.dumps({"device": "x", "torch": "2", "cuda": "13", "rows": [{"what": "one eager", "kernels": {}}]})
    )
    with pytest.raises(ConfigError, match="lacks model, batch, seq, matmul"):
        calibration.load_kernels(str(path))


def test_runs_state_their_stack_and_compile_is_no_longer_a_missing_term():
    compiled = [r for r in RUNS if "torch.compile" in r.notes]
    assert compiled and all(r.stack == "compile" for r in compiled)
    assert all(r.stack == "eager" for r in RUNS if "torch.compile" not in r.notes)
    assert not any("torch.compile" in t.term for r in RUNS for t in r.unpriced)
