"""The timeline: every forward / backward / weight-grad of a microbatch, every send / recv, the
optimizer, with start and end on one clock.

On the CPU the clock is `time.perf_counter` (CLOCK_MONOTONIC on Linux: one clock for every
process on a host, so ranks on one host line up without any handshake). Across hosts the Lab
adds each host's offset, measured at start-up. On CUDA, spans are CUDA events recorded on the
stream without blocking and resolved to seconds once, at the end of the step (STYLE.md habit
9: no synchronize() per op just to time it); the waits for the stream poll an event
(engines/device.py), so a cancel is seen while the GPU works.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from labkit.engines import device as devices


class Timeline:
    def __init__(self, device: torch.device | None = None, clock=time.perf_counter, check=None):
        self.clock = clock
        self.device = device
        self.check = check  # called while waiting for the GPU (runtime.check_cancelled raises)
        self.events: list[dict] = []
        self.open: list[dict] = []
        """The spans entered and not yet left, innermost last (engines/routes.py reads which
        microbatch a forward belongs to)."""
        self.step = -1
        self._cuda = device is not None and device.type == "cuda"
        self._pending: list[tuple[dict, object, object]] = []
        self._anchor = None  # (cuda event, clock time) taken at the start of a step

    def begin_step(self, step: int) -> None:
        self.step = step
        if self._cuda:
            devices.wait(self.device, self.check)  # once per step: pins the event clock to the host clock
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._anchor = (ev, self.clock())

    @contextmanager
    def span(self, kind: str, microbatch: int | None = None, chunk: int | None = None, **extra):
        """Record one event of `kind` ('F', 'B', 'W', 'send', 'recv', 'opt', 'step', ...)."""
        ev = {"kind": kind, "microbatch": microbatch, "chunk": chunk, "step": self.step, **extra}
        self.open.append(ev)
        try:
            yield from self._timed(ev)
        finally:
            self.open.pop()

    def _timed(self, ev: dict):
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield ev
            finally:
                end.record()
                self._pending.append((ev, start, end))
                self.events.append(ev)
        else:
            ev["start"] = self.clock()
            try:
                yield ev
            finally:
                ev["end"] = self.clock()
                self.events.append(ev)

    def end_step(self) -> None:
        """Resolve CUDA events to host-clock seconds (one wait for the stream per step)."""
        if not self._pending:
            return
        devices.wait(self.device, self.check)
        anchor, t0 = self._anchor
        for ev, start, end in self._pending:
            ev["start"] = t0 + anchor.elapsed_time(start) / 1e3
            ev["end"] = t0 + anchor.elapsed_time(end) / 1e3
        self._pending.clear()
