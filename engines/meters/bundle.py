"""One object that carries a rank's three meters through a step, and their report."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from labkit.config import DIMS
from labkit.engines import runtime
from labkit.engines.device import wait
from labkit.engines.mesh import Mesh
from labkit.engines.meters.comm import CommMeter
from labkit.engines.meters.memory import MemoryMeter
from labkit.engines.meters.timeline import Timeline
from labkit.layout.mesh import COMBINED, hybrid_combined


def dims_by_ranks(mesh: Mesh) -> dict[tuple[int, ...], str]:
    """Group ranks -> dim name, for every group of every (combined) dim of the layout.

    A single dim wins over a combination with the same ranks (with cp == 1 the dp-cp groups are
    the dp groups, and are called 'dp'); groups below a dim (MeshLayout.subgroups) go by its
    name. HSDP's shard and replicate groups are never another dim's ranks (each half of dp has
    2 ranks or more), so they keep their own names. Groups created by PyTorch itself (DTensor's
    or FSDP2's DeviceMesh) map by their ranks too.
    """
    out: dict[tuple[int, ...], str] = {}
    every = [(d,) for d in DIMS] + [mesh.layout.canonical(c) for c in COMBINED]
    for dims in every + hybrid_combined(mesh.layout):  # HSDP's 'dp_shard' and 'dp_replicate' after
        for g in mesh.layout.groups(*dims):
            if len(g) > 1:
                out.setdefault(tuple(g), mesh.layout.label(*dims))
    for dim, _, g in mesh.layout.subgroups():  # a shared KV head's tp ranks, a tied embedding's stages, cp's levels
        out.setdefault(tuple(g), dim)
    return out


class Meters:
    """comm is the job's collective log (engines/runtime.py), which runs from the job's first line
    to its last; the report keeps the part of it recorded inside `with meters:` (the steps).
    Outside a Lab job, or with comm_log=False (the overhead benchmark), comm is a meter of its
    own, entered with the bundle (comm_log=True) or never (False: no collective is recorded)."""

    def __init__(self, mesh: Mesh, device: torch.device, comm_log: bool = True):
        self.mesh = mesh
        self.device = device
        job_log = runtime.job_comm_meter() if comm_log else None
        self.comm = job_log or CommMeter({})
        self.comm.dims_by_ranks.update(dims_by_ranks(mesh))
        self._own_comm = comm_log and job_log is None
        self._span = [0, None]  # the report's slice of self.comm.events
        self.memory = MemoryMeter()
        self.timeline = Timeline(device, check=runtime.check_cancelled)
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self._own_comm:
            self.comm.__enter__()
        self._span = [len(self.comm.events), None]
        return self

    def __exit__(self, *exc):
        if self._own_comm:
            self.comm.__exit__(*exc)
        self.comm.sweep()
        self._span[1] = len(self.comm.events)

    def comm_events(self) -> list[dict]:
        """The collectives of the steps, as CommEvent dicts (group creation and the log-only
        process-group name left out)."""
        first, last = self._span
        return [
            {k: v for k, v in e.items() if k not in ("pg", "members", "error")}
            for e in self.comm.events[first:last]
            if e["op"] != "new_group"
        ]

    @contextmanager
    def step(self, step: int, model_state_bytes: int):
        self.comm.step = step
        self.timeline.begin_step(step)
        self.memory.set_states(model_state_bytes)
        self.memory.reset_peaks()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with self.span("step"):
            yield
        self.timeline.end_step()

    @contextmanager
    def phase(self, name: str):
        before, self.comm.phase = self.comm.phase, name
        try:
            yield
        finally:
            self.comm.phase = before

    def span(self, kind: str, microbatch=None, chunk=None, **extra):
        return self.timeline.span(kind, microbatch, chunk, **extra)

    @staticmethod
    def check_cancelled() -> None:
        runtime.check_cancelled()

    def wait_device(self) -> None:
        """Before the host reads a value the GPU computes (a loss, a norm): wait for the stream
        by polling, so a cancel is seen and a hung collective does not block the thread in CUDA."""
        wait(self.device, runtime.check_cancelled)

    def memory_report(self, states: dict[str, int]) -> dict[str, int]:
        """Bytes: params, grads, optimizer (persistent, after the step), activations (peak of the
        last step) and peak: CUDA's max_memory_allocated, or on the CPU the largest sum of model
        states and live transients (activations, gathered parameters) the meters saw."""
        out = dict(states)
        out["activations"] = self.memory.peak_of.get("activations", 0)
        for k, v in self.memory.peak_of.items():
            if k != "activations":
                out[k] = v
        if self.cuda:
            out["peak"] = int(torch.cuda.max_memory_allocated(self.device))
        else:
            out["peak"] = int(max(self.memory.peak, sum(states.values())))
        return out
