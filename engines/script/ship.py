"""What a script's process tells its engine, as it happens: one JSON message per line on a pipe.

The child (engines/script/boot.py) meters the script with labkit's own comm meter and a Tracker,
and a thread here ships, every TICK_S, what changed since its last look: the collectives entered
(`ev`), those left or failed since (`end`, `err`), how far each process group got and which groups
exist (`groups`: what the hang diagnosis compares across ranks), the dims of the meshes the script
built (`dims`), the main thread's stack (`stack`: where a rank in no collective is computing), the
steps the Tracker closed (`progress`). At the end the whole report (`report`) and, if the script
raised, its traceback (`failure`). The engine side reads them into the job's collective log
(engines/script/log.py). A script that ends with os._exit loses at most the last TICK_S of the log.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

from labkit.engines import runtime

TICK_S = 0.05
"""How often the shipper looks: a hang diagnosed at a timeout reads a log at most this stale."""
STACK_S = 0.5
"""How often the main thread's stack is taken (only shipped when it changed)."""
JOIN_S = 5.0
"""How long the end waits for this thread's last look (a tick, or a stack taken)."""


class Channel:
    """The write end of the pipe to the engine: whole lines, one writer at a time."""

    def __init__(self, fd: int):
        self.fd = fd
        self.lock = threading.Lock()
        self.closed = False

    def send(self, kind: str, *body) -> None:
        data = (json.dumps([kind, *body], default=str) + "\n").encode()
        with self.lock:
            if self.closed:
                return
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError:  # the engine is gone: the script goes on, unmeasured, until it dies too
                self.closed = True


class Shipper(threading.Thread):
    """Every TICK_S, the changes of the comm meter's log and the Tracker's steps, sent on `channel`."""

    def __init__(self, channel: Channel, meter, main: threading.Thread):
        super().__init__(name="labkit-shipper", daemon=True)
        self.channel, self.meter, self.main = channel, meter, main
        self.sent = 0  # meter.events[:sent] have been shipped
        self.open: list[int] = []  # shipped while still open: their end or error is still to send
        self.progress = 0
        self.last: dict = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        stack_at = 0.0
        while not self.stopped.wait(TICK_S):
            self.flush()
            if time.monotonic() - stack_at > STACK_S:
                stack_at = time.monotonic()
                self._changed("stack", self._stack())

    def flush(self) -> None:
        """Ship what changed since the last look (also called once at the end)."""
        with self.lock:
            self.meter.sweep()
            events = self.meter.events
            still = []
            for i in self.open:
                e = events[i]
                if e.get("error"):
                    self.channel.send("err", i, e["error"])
                elif e["end"] is not None:
                    self.channel.send("end", i, e["end"])
                else:
                    still.append(i)
            n = len(events)  # once: the script's thread appends while this ships
            for i in range(self.sent, n):
                e = events[i]
                self.channel.send("ev", {k: v for k, v in e.items() if k != "error"})
                if e["end"] is None or e.get("error"):
                    still.append(i)
            self.sent, self.open = n, still
            self._changed("groups", self.meter.group_counts(), runtime.group_registry())
            self._changed("dims", sorted([list(k), v] for k, v in self.meter.dims_by_ranks.items()))
            records = runtime.current_job().progress  # the Tracker's closed steps (runtime.progress)
            for rec in records[self.progress :]:
                self.channel.send("progress", rec)
            self.progress = len(records)

    def _changed(self, kind: str, *body) -> None:
        if self.last.get(kind) != body:
            self.last[kind] = body
            self.channel.send(kind, *body)

    def _stack(self) -> str:
        frame = sys._current_frames().get(self.main.ident)
        return "".join(traceback.format_stack(frame)[-4:]) if frame is not None else ""

    def stop(self) -> None:
        """The last flush, and this thread ended before the script's process exits: a daemon thread still in
        torch's C++ (the meter's sweep) when Python finalizes is ended by pthread_exit, whose unwinding
        through pybind11's noexcept frames aborts the process ('terminate called without an active
        exception', exit -6: seen once in 20 `sys.exit(3)`s before this join; never under torchrun)."""
        self.stopped.set()
        self.flush()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(JOIN_S)
