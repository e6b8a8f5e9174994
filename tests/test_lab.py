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


BROKEN = """
import sys
if "ipyparallel.engine" in sys.orig_argv:  # the engines only: the controller starts as usual
    import ipyparallel.engine.app as app

    def main():  # each engine's start, forked (labkit/cluster/forked.py) or not
        sys.exit("this engine's environment is broken (a sitecustomize.py of tests/test_lab.py)")

    app.main = main
"""


def test_engines_that_exit_at_their_start_are_said_with_what_they_wrote(tmp_path, monkeypatch):
    from labkit import Lab
    from labkit.cluster.errors import LabError

    (tmp_path / "sitecustomize.py").write_text(BROKEN)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # what every process the Lab starts inherits
    with pytest.raises(LabError) as got:
        Lab(engines=2, device="cpu", progress=False)
    said = str(got.value)
    assert "the engines exited while the Lab started" in said and "'exit_code': 1" in said
    # ipyparallel's error has the exit codes only: each engine's own last words are what tells why
    broken = "this engine's environment is broken"
    assert broken in said.split("--- engine 0, the last lines it wrote ---")[1].split("--- engine 1")[0], said
    assert f"--- engine 1, its last line ---\n{broken}" in said, said


def test_a_local_labs_engines_are_forked_from_one_process(lab):
    """The engines of a local Lab are forked from one process that imported torch once
    (labkit/cluster/forked.py): one parent, each engine named for what it is, and the census
    (`labkit who`) tells the engines from their parent, whose command line they share."""
    import psutil

    from labkit.cluster.census import role
    from labkit.cluster.forked import ENGINE_NAME

    engines = [psutil.Process(pid) for pid in lab.engines.pids]
    parents = {p.ppid() for p in engines}
    assert len(parents) == 1, parents
    parent = psutil.Process(parents.pop())
    assert "labkit.cluster.forked" in parent.cmdline() and "ipyparallel.engine" in parent.cmdline()
    assert [p.name() for p in engines] == [ENGINE_NAME] * 4
    assert [role(p) for p in engines] == ["engine"] * 4 and role(parent) == "engine set"
    # shared, not copied: torch's pages stay the parent's until an engine writes them
    assert sum(p.memory_full_info().pss for p in engines) < sum(p.memory_info().rss for p in engines)


NO_TORCH = """
import sys
if "labkit.cluster.forked" in sys.orig_argv:  # the engines' parent only: it cannot import torch
    sys.modules["torch"] = None
"""


def test_an_engine_set_that_fails_before_it_forks_is_said(tmp_path, monkeypatch):
    from labkit import Lab
    from labkit.cluster.errors import LabError

    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(LabError) as got:
        Lab(engines=2, device="cpu", progress=False)
    said = str(got.value)
    assert "the engines exited while the Lab started" in said, said
    assert "--- engine set, the last lines it wrote ---" in said and "ModuleNotFoundError" in said, said


def test_engines_end_with_the_process_they_were_forked_from():
    """SIGKILL to the engines' parent (it cannot pass anything on) still ends every engine: each
    asked the kernel for SIGKILL at its parent's death (PR_SET_PDEATHSIG)."""
    import os
    import signal

    import psutil

    from labkit import Lab

    with Lab(engines=2, device="cpu", progress=False) as lab:
        engines = [psutil.Process(pid) for pid in lab.engines.pids]
        os.kill(engines[0].ppid(), signal.SIGKILL)
        gone, alive = psutil.wait_procs(engines, timeout=10)
        assert not alive, alive


TAKE_ONCE = """
import os, sys
if "ipyparallel.controller" in sys.orig_argv and not os.path.exists(os.environ["LABKIT_TEST_ONCE"]):
    open(os.environ["LABKIT_TEST_ONCE"], "w").close()  # the first controller only
    from ipyparallel import util
    picks, pick = [], util.select_random_ports

    def select_random_ports(n):  # ipyparallel's own pick, but its 6th port (hb_ping) is one a test holds
        picks.append(n)
        return [int(os.environ["LABKIT_TEST_HELD"])] if len(picks) == 6 else pick(n)

    util.select_random_ports = select_random_ports
"""


def test_a_controller_port_taken_before_it_binds_starts_the_cluster_again(tmp_path, monkeypatch):
    """ipyparallel picks the controller's ports, closes them, and binds them later; here a port
    is already taken when its heart monitor binds it (another process's, as on a loaded machine:
    benchmarks/port_race.py), so no engine is ever pinged and each exits after its missed heartbeats."""
    import socket

    from labkit import Lab
    from labkit.cluster.startup import TAKEN

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    (tmp_path / "sitecustomize.py").write_text(TAKE_ONCE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("LABKIT_TEST_ONCE", str(tmp_path / "once"))
    monkeypatch.setenv("LABKIT_TEST_HELD", str(held.getsockname()[1]))
    try:
        with Lab(engines=2, device="cpu", progress=False, timeout=60) as lab:
            retries = lab.engines.started.retries
            print(f"\nthe first start, tried again: {retries}")
            assert len(retries) == 1 and TAKEN in retries[0] and str(held.getsockname()[1]) in retries[0], retries
            assert lab.apply(_rank_and_world) == [(0, 2), (1, 2)]
    finally:
        held.close()
