"""The job thread's device: bound first thing in the thread, and waited for without blocking.

CUDA's current device belongs to each host thread, and a new thread starts on cuda:0
(pytorch-pfn-extras PR #726, NVIDIA resiliency-ext PR #103): the Lab's jobs run in their own
thread (engines/runtime.py), so without `bind` every rank's events, streams, FSDP2's default
device and batch_isend_irecv's communicator lookups would land on cuda:0.

`wait` returns once the current stream has run everything queued on it, polling an event instead
of blocking in synchronize(): a cancel is seen while it waits, and the thread does not hold the
CUDA context lock that NCCL's watchdog needs for its own event queries (PyTorch's note in
WorkNCCL::finishedGPUExecutionInternal). On the CPU both do nothing.
"""

from __future__ import annotations

import time

import torch

POLL_S = 2e-4
"""Between two queries of the event: short next to a step, long enough to leave the GIL to others."""


def bind(device: str) -> None:
    """Make `device` ('cpu' or 'cuda:N') the calling thread's current CUDA device."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def wait(device: torch.device, check=None) -> None:
    """Until the current stream of `device` is idle; check() (e.g. runtime.check_cancelled, which
    raises) runs between polls."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        if check is not None:
            check()
        time.sleep(POLL_S)
