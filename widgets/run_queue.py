"""The one background thread that calls the Lab for a widget: the latest request, once it has rested.

A slider dragged through five values runs the last one, once: a request waits its delay (the
debounce) and a newer one takes its place. The Lab is not safe to call concurrently, so requests
run one at a time, all in this thread; the kernel's thread only queues them, and stays free to
draw while a run is in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RunQueue:
    """run(request) in one background thread, for the latest request once its delay is over.

    on_error(e): what becomes of an exception `run` raised, which a thread would otherwise lose.
    """

    def __init__(self, run: Callable[[object], None], on_error: Callable[[Exception], None], name: str):
        self._run, self._on_error = run, on_error
        self._cv = threading.Condition()
        self._pending: object | None = None
        self._due = 0.0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a request is running now."""
        return self._busy

    @property
    def idle(self) -> bool:
        """Whether nothing is queued and nothing runs."""
        with self._cv:
            return self._pending is None and not self._busy

    def put(self, request, delay: float) -> None:
        """Run `request` `delay` seconds from now, in place of any request still queued."""
        with self._cv:
            self._pending = request
            # monotonic: a jump of the wall clock must neither fire nor stall the debounce
            self._due = time.monotonic() + delay
            self._cv.notify_all()

    def drop(self) -> bool:
        """Forget the queued request, if any; returns whether one is running."""
        with self._cv:
            self._pending = None
            self._cv.notify_all()
            return self._busy

    def wait(self, seconds: float) -> None:
        """Until the queue changes, at most `seconds`."""
        with self._cv:
            self._cv.wait(seconds)

    def close(self, timeout: float = 60) -> None:
        """Stop the thread, after the request in flight (waited for at most `timeout` seconds)."""
        with self._cv:
            self._closed = True
            self._pending = None
            self._cv.notify_all()
        self._thread.join(timeout=timeout)

    def _worker(self) -> None:
        while True:
            with self._cv:
                # a newer put moves _due on: the loop waits again, so only a request that rested its delay runs
                while not self._closed and (self._pending is None or time.monotonic() < self._due):
                    self._cv.wait(None if self._pending is None else max(0.0, self._due - time.monotonic()))
                if self._closed:
                    return
                request, self._pending = self._pending, None
                # taken and marked busy under one lock: `idle` never sees a request between queued and running
                self._busy = True
            try:
                self._run(request)
            except Exception as e:  # noqa: BLE001 - shown by on_error, never lost in a thread
                self._on_error(e)
            finally:
                with self._cv:
                    # wakes wait() (Dashboard.wait in the kernel's thread), which then finds the queue idle at once
                    self._busy = False
                    self._cv.notify_all()
