"""Where the collective log stamps an op's end (engines/meters/comm.py), on the CPU: a CUDA
op that returns no Work (a blocking NCCL collective since torch 2.7) is polled through a StreamMark
and stays open until the mark completes; the CPU paths are unchanged. And the verdict of the GPU
probe that checks the same on NCCL (benchmarks/nccl_shared.py `meter_verdict`), on both outcomes.

The log runs here in this process, on a real gloo world of one rank. The GPU's progress, which a
CUDA event reports on a GPU, is a threading.Event here: the mark only asks it `query() -> bool`."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from labkit.engines.meters import comm
from labkit.engines.meters.comm import CommMeter
from labkit.engines.meters.stream_mark import StreamMark


@pytest.fixture(scope="module")
def world():
    """A gloo world of one rank in this process, the log's kernels installed; both undone after."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm.install()
    yield dist.group.WORLD
    comm.uninstall()
    comm.forget_groups()
    dist.destroy_process_group()


def test_an_op_without_work_stays_open_until_the_gpu_has_run_it(world):
    meter = CommMeter({})
    t = torch.ones(4)
    ev = meter.begin("all_reduce", world, t, t.numel() * t.element_size())
    gpu_ran = threading.Event()
    meter.watch(StreamMark(gpu_ran.is_set), ev, on_device=True)
    # the call has returned, the GPU has not run the op: the log says where the rank waits
    assert ev["end"] is None and meter.open_events() == [ev]
    gpu_ran.set()
    assert meter.open_events() == [] and ev["end"] >= ev["start"] and "error" not in ev


def test_a_later_op_sweeps_the_marks_of_earlier_ones(world):
    meter = CommMeter({})
    t = torch.ones(4)
    first = meter.begin("all_reduce", world, t, 16)
    gpu_ran = threading.Event()
    meter.watch(StreamMark(gpu_ran.is_set), first, on_device=True)
    gpu_ran.set()
    second = meter.begin("broadcast", world, t, 16)  # begin sweeps what is pending
    assert first["end"] is not None and second["end"] is None and meter.open_events() == [second]


def test_the_cpu_paths_end_as_before(world):
    with CommMeter({}) as meter:
        t = torch.ones(8)
        dist.all_reduce(t)  # blocking: ended at its return, nothing left to poll
        blocking = meter.events[-1]
        assert blocking["op"] == "all_reduce" and blocking["end"] is not None and not meter._pending
        work = dist.all_reduce(t, async_op=True)  # async: its future's callback ends it
        work.wait()
        meter.sweep()
        assert meter.events[-1]["end"] is not None and meter.open_events() == []


@pytest.fixture(scope="module")
def probe(bench_script):
    return bench_script("nccl_shared")


def test_the_probe_passes_the_log_only_when_its_end_follows_the_gpu(probe):
    # the 2026-11-26 behaviour: the end stamped at the call's return while the GPU slept
    assert probe.meter_verdict({"return_s": 0.0002, "end_at_return": True}).startswith("FAIL")
    never = {"return_s": 0.0002, "end_at_return": False, "end_after_t0_s": None, "gpu_ran_s": 0.52}
    assert probe.meter_verdict(never).startswith("FAIL: the log never")
    early = {"return_s": 0.0002, "end_at_return": False, "end_after_t0_s": 0.1, "gpu_ran_s": 0.52}
    assert probe.meter_verdict(early).startswith("FAIL") and "before the GPU" in probe.meter_verdict(early)
    # a poll after the GPU's own event, or one poll before it (the loop reads the log first)
    for end in (0.53, 0.52 - probe.POLL_S):
        row = {"return_s": 0.0002, "end_at_return": False, "end_after_t0_s": end, "gpu_ran_s": 0.52}
        assert probe.meter_verdict(row).startswith("PASS"), end
