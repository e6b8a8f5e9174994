"""The Lab itself: apply, progress, idle ranks, errors before engine work, results on disk."""

from __future__ import annotations

import json

import pytest
from conftest import TINY

from labkit import ConfigError, ParallelConfig, RunResult


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_apply_runs_on_every_rank_in_order(lab):
    assert lab.apply(_rank_and_world) == [(r, 4) for r in range(4)]


def _all_reduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return float(t)


def test_apply_with_a_collective(lab):
    assert lab.apply(_all_reduce_rank) == [6.0] * 4


def test_progress_is_reported_per_step_with_the_global_loss(lab):
    seen = []
    res = lab.run(ParallelConfig(dp=4), model=TINY, steps=3, progress=seen.append)
    assert [p["step"] for p in seen] == [0, 1, 2]
    assert [p["loss"] for p in seen] == pytest.approx(res.losses, rel=1e-12)


def test_bad_config_is_refused_before_engine_work(lab):
    with pytest.raises(ConfigError, match="engines"):
        lab.run(ParallelConfig(dp=8), model=TINY)
    with pytest.raises(ConfigError, match="steps=0"):
        lab.run(ParallelConfig(dp=2), model=TINY, steps=0)
    assert lab.apply(_rank_and_world)[3] == (3, 4)  # the Lab is untouched


def test_result_round_trip_and_trace(lab, tmp_path):
    res = lab.run(ParallelConfig(dp=2), model=TINY, steps=2, return_params=True)
    path = tmp_path / "run.json"
    res.save(path)
    back = RunResult.load(path)
    assert back.losses == res.losses
    assert back.comm_table() == res.comm_table()
    assert back.ranks[1].coords == res.ranks[1].coords
    assert all((back.params[k] == v).all() for k, v in res.params.items())
    trace = tmp_path / "trace.json"
    res.save_trace(trace)
    events = json.load(open(trace))["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"F0", "B0", "opt", "all_reduce[dp]"} <= names
    assert {e["pid"] for e in events} == {0, 1}


def test_timeline_is_on_one_clock(lab):
    res = lab.run(ParallelConfig(dp=4), model=TINY, steps=2)
    steps = [[e for e in rk.timeline if e.kind == "step" and e.step == 1][0] for rk in res.ranks]
    # every rank's step 2 overlaps every other's: the all-reduce ties them together
    assert max(s.start for s in steps) < min(s.end for s in steps)
    assert min(e.start for rk in res.ranks for e in rk.timeline) == 0.0


def test_device_choice_is_checked_before_starting():
    from labkit import Lab

    with pytest.raises(ConfigError, match="device='tpu'"):
        Lab(engines=1, device="tpu")
    with pytest.raises(ConfigError, match="nccl' needs GPUs"):
        Lab(engines=1, device="cpu", backend="nccl")
