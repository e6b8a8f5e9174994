"""Which way a rank is released (engines/release.py): on NCCL the Lab aborts every live rank's
communicators, its job running or not (a rank waiting in an NCCL collective waits in a GPU kernel that
no socket reaches); on gloo it cuts the sockets of the ranks whose job is over, as before. The GPU
proof (a skipped all-reduce, a raising rank, a killed engine on NCCL: benchmarks/gpu_faults.py) runs
in scripts/gpu-check.sh.

The release itself runs here in this process on a real gloo world of one rank; torch's own
`_abort_process_group` runs on it where the rank is labelled an NCCL one (the abort route's torch calls
are the same for every backend; what NCCL adds is the kernel it ends)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from labkit.engines import release, runtime


@pytest.mark.parametrize(
    "backend, alive, abort, want",
    [
        ("nccl", True, True, "abort"),  # stuck in a kernel: only an abort frees it
        ("nccl", False, True, "abort"),  # over: its communicators go too, before the sockets
        ("nccl", True, False, "wait"),
        ("gloo", True, False, "wait"),  # freed by its peers' releases, released once over
        ("gloo", False, False, "sockets"),
        ("gloo", True, True, "wait"),  # an abort does not free a gloo collective (engines/runtime.py)
        ("", False, True, "sockets"),  # not in a world
    ],
)
def test_the_route_by_backend_and_job(backend, alive, abort, want):
    assert release.route(backend, alive, abort) == want


@pytest.fixture
def one_rank():
    """A gloo world of one rank in this process, recorded as the engine's runtime with `backend`."""

    def join(backend: str):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        runtime.set_current(runtime.Runtime(0, 1, backend, "cpu", "here", 30.0, 1))

    yield join
    runtime.set_current(None)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_gloo_rank_whose_job_is_over_is_cut_off_and_leaves_its_world(one_rank):
    one_rank("gloo")
    got = release.release((), abort=False)
    assert got == {"state": runtime.current_job().state, "held": 0, "route": "sockets"}
    assert not dist.is_initialized() and not runtime.in_world()


def test_an_nccl_rank_is_aborted_then_cut_off(one_rank):
    one_rank("nccl")
    got = release.release((), abort=True)
    assert got["route"] == "abort" and got["held"] == 0
    assert not dist.is_initialized() and not runtime.in_world()


def test_a_running_job_keeps_its_world_on_gloo_and_loses_it_to_an_abort_on_nccl(one_rank):
    import threading

    from labkit.engines.meters import comm

    one_rank("gloo")
    gate = threading.Event()
    runtime.start(gate.wait, (60,))  # a real job thread, waiting as a rank stuck in a collective would
    try:
        assert release.release((), abort=False) == {"state": "running", "held": 0, "route": "wait"}
        assert dist.is_initialized() and runtime.in_world()
        runtime.set_current(runtime.Runtime(0, 1, "nccl", "cpu", "here", 30.0, 1))
        got = release.release((), abort=True)  # the job still runs: on NCCL its communicators go anyway
        assert got["route"] == "abort" and got["state"] == "running" and not dist.is_initialized()
    finally:
        gate.set()
        runtime.current_job().thread.join(10)
        comm.uninstall()
    assert runtime.current_job().state == "done"
