"""The planner's missing measurements (labkit/theory/planner/measured.py): the eager
stack's pace per kernel size, the paces inside an FSDP step, NCCL's latency and channels on a node. The
file in the repository is empty until a GPU fills it (benchmarks/gpu_planner.py): then the planner prices
as before and says what it assumes. Points written here as the script writes them change exactly what
they measure; a point that is a row the planner is judged on is refused."""

from __future__ import annotations

import json

import pytest

from labkit import ParallelConfig, theory
from labkit.theory.planner import audit, measured, stacks
from labkit.theory.planner.hardware import ALPHA_ASSUMED, CHANNELS_ASSUMED, H100
from labkit.theory.presets import LLAMA31_8B, PRESETS

DDP = ParallelConfig(dp=8, global_batch=16, precision="bf16")
FSDP = ParallelConfig(dp=8, global_batch=16, precision="bf16", sharding="fsdp")


def _file(tmp_path, monkeypatch, **lists) -> str:
    path = tmp_path / "planner_measurements.json"
    path.write_text(json.dumps({"eager_pace": [], "fsdp_step": [], "nccl": [], **lists}))
    monkeypatch.setattr(measured, "PATH", str(path))
    return str(path)


def _pace(kernel_bytes: float, slowdown: float, model="gpt2-124m", device="NVIDIA H100 80GB HBM3") -> dict:
    return {
        "device": device,
        "stack": "eager",
        "model": model,
        "batch": 16,
        "seq": 1024,
        "kernel_bytes": kernel_bytes,
        "memory_slowdown": slowdown,
        "source": "test",
    }


def _step(plan) -> float:
    return plan.step_seconds


def test_the_repositorys_file_is_a_measurement_file_with_no_validation_row_in_it():
    data = measured.load()
    assert set(measured.FIELDS) <= set(data) and audit.calibration_problems() == []


def test_while_nothing_is_measured_the_planner_says_what_it_assumes(tmp_path, monkeypatch):
    _file(tmp_path, monkeypatch)
    hw = stacks.with_stack(H100, "eager")
    assert hw.memory_pace == () and hw.copy_slowdown == 1.0
    said = " | ".join(hw.assumptions)
    assert "pace per kernel size: not measured at two sizes" in said and "FSDP's copies" in said
    assert ALPHA_ASSUMED in hw.assumptions and CHANNELS_ASSUMED in hw.assumptions
    assert hw.slowdown_at(1e3) == hw.slowdown_at(1e9) == stacks.slowdowns("eager")[0]


def test_the_pace_is_log_linear_between_points_and_flat_past_them():
    points = ((1e6, 3.0), (1e8, 1.5))
    assert measured.pace(points, 1e3) == 3.0 and measured.pace(points, 1e10) == 1.5
    assert measured.pace(points, 1e7) == pytest.approx(2.25)  # the geometric middle: the mean of the paces


def test_one_size_is_no_curve_and_points_come_from_one_device(tmp_path, monkeypatch):
    _file(tmp_path, monkeypatch, eager_pace=[_pace(5e7, 2.0), _pace(5e7, 2.2, model="llama3.2-1b")])
    assert measured.pace_points("eager") == ()  # two steps, one size
    other = _pace(1e6, 9.0, device="NVIDIA H200")
    _file(tmp_path, monkeypatch, eager_pace=[_pace(5e7, 2.0), _pace(2e8, 1.6, model="llama3.2-1b"), other])
    assert measured.pace_points("eager") == ((5e7, 2.0), (2e8, 1.6))


def test_measured_paces_price_the_elementwise_kernels(tmp_path, monkeypatch):
    base = _step(theory.evaluate(DDP, LLAMA31_8B, "h100"))
    m = stacks.slowdowns("eager")[0]
    _file(tmp_path, monkeypatch, eager_pace=[_pace(1e5, m), _pace(1e10, m, model="llama3.2-1b")])
    assert _step(theory.evaluate(DDP, LLAMA31_8B, "h100")) == pytest.approx(base, rel=1e-12)
    _file(tmp_path, monkeypatch, eager_pace=[_pace(1e5, 2 * m), _pace(1e10, 2 * m, model="llama3.2-1b")])
    slower = theory.evaluate(DDP, LLAMA31_8B, "h100")
    assert _step(slower) > base and any("measured at 2 sizes" in a for a in slower.hw.assumptions)


def test_fsdp_copies_at_their_measured_pace_and_nothing_else_moves(tmp_path, monkeypatch):
    before = {c.sharding: _step(theory.evaluate(c, LLAMA31_8B, "h100")) for c in (DDP, FSDP)}
    row = {"device": "NVIDIA H100 80GB HBM3", "stack": "eager", "model": "llama3.2-1b", "batch": 4, "seq": 2048}
    row |= {"world": 1, "copy_slowdown": 3.0, "memory_slowdown": 2.0, "optimizer_slowdown": 1.1, "source": "test"}
    _file(tmp_path, monkeypatch, fsdp_step=[row])
    after = {c.sharding: _step(theory.evaluate(c, LLAMA31_8B, "h100")) for c in (DDP, FSDP)}
    assert after[DDP.sharding] == before[DDP.sharding] and after["fsdp"] > before["fsdp"]


def test_nccl_on_a_shared_gpu_is_recorded_not_read_and_a_nodes_replaces_the_assumption(tmp_path, monkeypatch):
    shared = {"device": "NVIDIA H100 80GB HBM3", "gpus": 1, "ranks_per_gpu": 2, "op": "all_reduce"}
    shared |= {"bytes": 8, "seconds": 40e-6, "channels": 4, "source": "test"}
    _file(tmp_path, monkeypatch, nccl=[shared])
    assert measured.nccl_latency() is None and measured.nccl_channels() is None
    assert stacks.measured_links(H100) is H100
    node = dict(shared, gpus=8, ranks_per_gpu=1, seconds=28e-6, channels=24)
    _file(tmp_path, monkeypatch, nccl=[shared, node])
    hw = stacks.measured_links(H100)
    assert hw.intra.alpha == pytest.approx(28e-6 / 14) and hw.nccl_channels == 24  # a ring of 8: 14 steps
    assert ALPHA_ASSUMED not in hw.assumptions and CHANNELS_ASSUMED not in hw.assumptions


def test_a_row_the_planner_is_judged_on_is_refused_as_a_calibration_point(tmp_path, monkeypatch):
    presets = {(m.layers, m.hidden, m.vocab): name for name, m in PRESETS.items()}
    run = next(r for r in audit.ALL if (r.model_config.layers, r.model_config.hidden, r.model_config.vocab) in presets)
    m = run.model_config
    point = dict(_pace(5e7, 2.0), model=presets[(m.layers, m.hidden, m.vocab)], seq=m.seq)
    point["batch"] = run.config.global_batch // run.config.dp
    path = _file(tmp_path, monkeypatch, eager_pace=[point])
    found = audit.calibration_problems(path)
    assert len(found) == 1 and "calibration rows never become validation rows" in found[0]
    malformed = _file(tmp_path, monkeypatch, eager_pace=[{"device": "x"}])
    assert "lacks or mistypes" in audit.calibration_problems(malformed)[0]
