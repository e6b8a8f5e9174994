"""The GPU code paths that can be checked on the CPU: the job thread binds its CUDA device
(torch.cuda patched), the flight recorder is read and diagnosed (a real gloo dump for its format,
made-up NCCL states for what a hang looks like), and waits for the device are cancellable.
No cluster: each test runs in this process or in a subprocess of its own."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from labkit.cluster.diagnose import analyse
from labkit.engines.flight import summary


def test_the_job_thread_binds_its_cuda_device_before_anything_else(monkeypatch):
    """CUDA's current device is per thread and a new thread starts on cuda:0: runtime.start must
    call set_device(rank's device) in the job thread, before the job's function runs."""
    import torch

    from labkit.engines import runtime

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", str(d), _thread())))
    monkeypatch.setattr(runtime._state, "runtime", runtime.Runtime(3, 4, "nccl", "cuda:3", "h", 10.0, 1))
    monkeypatch.setattr(runtime._state, "job", runtime.Job())
    runtime.start(lambda: seen.append(("fn", _thread())))
    runtime.current_job().thread.join(10)
    assert runtime.poll()["state"] == "done", runtime.poll()["error"]
    assert seen == [("set_device", "cuda:3", "labkit-job"), ("fn", "labkit-job")]


def test_a_cpu_rank_binds_no_device(monkeypatch):
    import torch

    from labkit.engines import runtime

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(d))
    monkeypatch.setattr(runtime._state, "runtime", runtime.Runtime(0, 1, "gloo", "cpu", "h", 10.0, 1))
    monkeypatch.setattr(runtime._state, "job", runtime.Job())
    runtime.start(lambda: 7)
    runtime.current_job().thread.join(10)
    assert runtime.result() == 7 and calls == []


def _thread() -> str:
    return threading.current_thread().name


def test_waiting_for_the_device_polls_and_can_be_cancelled(monkeypatch):
    """device.wait polls an event (never synchronize()), calling check() between polls: a cancel
    raised there ends the wait. torch.cuda.Event is replaced by one that never completes."""
    import torch

    from labkit.engines import device

    class NeverDone:
        def record(self):
            pass

        def query(self):
            return False

    monkeypatch.setattr(torch.cuda, "Event", NeverDone)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize() blocks a cancel"))
    polls = []

    def check():
        polls.append(1)
        if len(polls) == 3:
            raise KeyboardInterrupt("cancelled")

    with pytest.raises(KeyboardInterrupt):
        device.wait(torch.device("cuda:0"), check)
    assert len(polls) == 3
    device.wait(torch.device("cpu"), check)  # nothing to wait for on the CPU
    assert len(polls) == 3


FR_GLOO = """
import json, torch, torch.distributed as dist
from labkit.engines.flight import summary
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(4)
dist.all_reduce(t); dist.all_reduce(t); dist.broadcast(t, src=0)
print(json.dumps(summary(json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False)))))
dist.destroy_process_group()
"""


def test_the_flight_recorder_dump_is_read_in_its_real_format():
    """A gloo world of one in a subprocess: three collectives on the default group give sequence
    numbers 1..3 on process group '0' (gloo's states say nothing: the Lab reads them on NCCL only)."""
    import json

    out = subprocess.run([sys.executable, "-c", FR_GLOO], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["entered"] == {"0": 3}
    assert [(e["op"], e["seq"], e["pg"]) for e in got["open"]] == [
        ("all_reduce", 1, "0"),
        ("all_reduce", 2, "0"),
        ("broadcast", 3, "0"),
    ]


def _fr_entry(pg: str, seq: int, state: str, name="nccl:all_reduce", t=0, p2p=False) -> dict:
    return {
        "process_group": [pg, "dp"],
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "is_p2p": p2p,
        "profiling_name": name,
        "state": state,
        "input_sizes": [[1024]],
        "record_id": t,
    }


def test_flight_summary_keeps_what_the_gpu_has_not_completed():
    """Open: not completed, and no later op of its group completed (a group's ops run in order;
    the ops inside a batch have no events of their own, the batch's 'coalesced' entry has)."""
    trace = {
        "entries": [
            _fr_entry("3", 1, "completed", t=1),
            _fr_entry("3", 2, "started", t=2),
            _fr_entry("0", 1, "completed", name="nccl:broadcast", t=0),
            _fr_entry("3", 3, "scheduled", name="nccl:all_gather", t=3),
            _fr_entry("5", 1, "scheduled", name="nccl:send 1", t=4, p2p=True),
            _fr_entry("5", 1, "scheduled", name="nccl:recv 1", t=5, p2p=True),
            _fr_entry("5", 1, "completed", name="nccl:coalesced", t=6, p2p=True),
        ]
    }
    got = summary(trace)
    assert got["entered"] == {"3": 3, "0": 1}
    assert [(e["op"], e["seq"], e["state"]) for e in got["open"]] == [
        ("all_reduce", 2, "started"),
        ("all_gather", 3, "scheduled"),
    ]


def _nccl_poll(state: str, entered: int, open_seq: int | None) -> dict:
    """A rank of a 4-rank NCCL world, as runtime.poll reports it: its log shows every op left
    (NCCL's works complete at enqueue); its flight record shows what the GPU did."""
    log = [
        {"op": "all_reduce", "dim": "dp", "group": [0, 1, 2, 3], "seq": s, "pg": "3", "start": s, "end": s + 0.1}
        for s in range(entered)
    ]
    gpu = {"open": [], "entered": {"3": entered}}
    if open_seq is not None:
        gpu["open"] = [
            {"op": "all_reduce", "pg": "3", "seq": open_seq, "p2p": False, "state": "scheduled", "sizes": [[1024]]}
        ]
    return {
        "state": state,
        "log": log,
        "groups": {"3": [entered, [0, 1, 2, 3]]},
        "registry": {"3": [0, 1, 2, 3]},
        "gpu": gpu,
    }


def test_a_hang_on_nccl_is_diagnosed_from_the_gpu_side():
    """Notebook 09's skip_collective on NCCL: rank 2 skipped the 5th all-reduce and finished; the
    others' GPUs wait in it. The log alone says nobody is inside a collective."""
    polls = {r: _nccl_poll("running", 5, 5) for r in (0, 1, 3)}
    polls[2] = _nccl_poll("done", 4, None)
    blind = analyse({r: {k: v for k, v in p.items() if k != "gpu"} for r, p in polls.items()})
    assert "no rank is inside a collective" in blind["text"]
    found = analyse(polls)
    assert set(found["gpu_stuck"]) == {0, 1, 3}
    assert [(m["ranks"], m["waiting"], m["seq"], m["op"]) for m in found["missing"]] == [
        ([2], [0, 1, 3], 5, "all_reduce")
    ]
    assert "rank 2 finished its job" in found["text"]
    assert "never enqueued all_reduce #5 on dp group [0, 1, 2, 3]" in found["text"]
    assert "no rank is inside a collective" not in found["text"]
