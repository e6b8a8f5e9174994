"""Jobs on a Lab's engines: one call at a time runs on every rank in the engines' job threads
(engines/runtime.py), polled until every rank is done or something goes wrong (labkit/cluster/faults.py
turns that into an error). A fault leaves the engines to repair; the repair runs at the start of
the next call: engines stuck or dead are replaced, and the process groups rebuilt on a fresh port.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from labkit.cluster import faults
from labkit.cluster.engine_set import ANSWER_S, START_TIMEOUT_S, EngineGone, EngineSet
from labkit.cluster.errors import Cancelled, LabError
from labkit.config import ConfigError
from labkit.engines import runtime

POLL_MIN_S, POLL_MAX_S = 0.02, 0.25
"""The runner polls the engines at first every 20 ms (short runs return at once), backing off to 4 per second."""


@contextlib.contextmanager
def interrupts_remembered():
    """Yields a function that says whether Ctrl-C came while the block ran.

    Python runs a signal's handler at the next bytecode of the main thread; when that bytecode is
    a weakref callback or a __del__ (ipyparallel's futures and zmq make many), the
    KeyboardInterrupt the handler raises is printed as "Exception ignored" and lost, and the
    call went on to its timeout (a CI run). The handler here notes the signal before it calls
    the one it replaces, so the poll loop can raise it. Only in the main thread, where signals
    are handled, and only over a Python-level handler (Python's own, or ipykernel's): a process that
    inherited SIGINT ignored (started in the background without job control) gets no Ctrl-C at all."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield lambda: False
        return
    hit = threading.Event()

    def handler(signum, frame):
        hit.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


class JobRunner:
    """Runs one job at a time on every rank of `engines`, and repairs them before the next.

    repairs: one entry per repair: engines replaced (rank -> why), whether all were restarted, seconds.
    jobs: how many calls have started work on the engines (tests check that a refusal starts none).
    """

    def __init__(self, engines: EngineSet):
        self.engines = engines
        self.repairs: list[dict] = []
        self.jobs = 0
        self._cancel_request = threading.Event()
        self._rebuild_needed = False  # the process groups are not known to be usable as they are

    def run(self, fn, args: tuple, kwargs: dict, timeout: float, steps, *, engine_groups: bool = True) -> list:
        """fn(*args, **kwargs) on every rank (after a repair if one is due); results in rank order.
        steps: the StepProgress fed with the ranks' progress records (progress.shown: silent or shown).
        engine_groups: whether the job uses the engines' own process groups. A script's job does not
        (its processes have a world of their own): then a failing rank stops the others, as torchrun's
        agent stops its workers (faults.stop_group), a timeout stops every rank instead of releasing
        them, and no fault makes the next call rebuild the groups (a dead engine still is replaced)."""
        lock = self.engines.lock
        # longer than any call can take (its timeout and two start-ups): one holding it longer is stuck
        if not lock.acquire(timeout=timeout + 2 * START_TIMEOUT_S):
            raise LabError("the Lab is busy with another call that did not end in time; lab.cancel() stops it")
        try:
            # a cancel meant for the previous call must not stop this one
            self._cancel_request.clear()
            self.repair_if_needed()
            with interrupts_remembered() as interrupted:
                return self._job(fn, args, kwargs, timeout, steps, interrupted, engine_groups=engine_groups)
        finally:
            lock.release()

    def cancel(self) -> None:
        """Stop the job in progress (from any thread) at its next step or microbatch boundary."""
        self._cancel_request.set()

    def states(self) -> list[str]:
        """Each rank's job state now ('idle', 'running', 'done', 'error', 'cancelled', or 'dead')."""
        out = []
        with self.engines.lock:
            for r in range(self.engines.world):
                try:
                    # 10**9: past every progress record, so the poll returns the state alone
                    out.append(self.engines.each(runtime.poll, [r], 10**9)[r]["state"])
                except EngineGone:
                    out.append("dead")
        return out

    def _job(self, fn, args, kwargs, timeout: float, steps, interrupted, *, engine_groups: bool) -> list:
        """Start fn on every rank and poll until every rank is done or something goes wrong
        (interrupted(): a Ctrl-C that Python may have lost, see interrupts_remembered)."""
        engines = self.engines
        ranks = range(engines.world)
        try:
            self._rebuild_needed = engine_groups  # until the job ends cleanly (a script's never touches them)
            engines.each(runtime.start, ranks, fn, args, kwargs, timeout)
            self.jobs += 1
            deadline = time.monotonic() + timeout
            # seen[r]: rank r's progress records already read; a poll returns only newer ones
            seen, pause, cancel_sent = [0] * engines.world, POLL_MIN_S, False
            while True:
                if interrupted():
                    raise KeyboardInterrupt
                if self._cancel_request.is_set() and not cancel_sent:
                    # once: the ranks stop at their next boundary, and the loop waits for them to say so
                    engines.each(runtime.cancel, ranks)
                    cancel_sent = True
                # every rank asked at once, each answer bounded: an engine that does not answer becomes EngineGone
                got = engines.gather({r: engines.send(r, runtime.poll, seen[r]) for r in ranks}, ANSWER_S)
                states = [got[r] for r in ranks]
                for r, s in enumerate(states):
                    seen[r] += len(s["progress"])
                    for rec in s["progress"]:
                        steps.add(rec)
                kinds = {s["state"] for s in states}
                if kinds == {"done"}:
                    # results fetched only once every rank is done: a partial result is no result
                    got = engines.each(runtime.result, ranks, bound=START_TIMEOUT_S)
                    self._rebuild_needed = False
                    return [got[r] for r in ranks]
                if "error" in kinds:
                    (faults.on_error if engine_groups else faults.stop_group)(engines, states, timeout)
                if "cancelled" in kinds or ("running" not in kinds and cancel_sent):
                    # the groups stay usable only if every rank stopped in step at a boundary
                    if faults.stop_after_cancel(engines):
                        self._rebuild_needed = False
                    raise Cancelled("the run was cancelled (Lab.cancel); it stopped on every rank")
                if time.monotonic() > deadline:
                    faults.on_timeout(engines, timeout, steps.reached(), release=engine_groups)
                time.sleep(pause)
                # backing off: a short run returns at once, a long one costs the engines few polls
                pause = min(POLL_MAX_S, pause * 1.5)
        except EngineGone as gone:
            faults.on_died(engines, gone)
        # already the clear error of a fault path, or a refused config: passed on as it is
        except (LabError, ConfigError):
            raise
        except BaseException:  # Ctrl-C, a progress callback that raised, a broken client
            if faults.abandon(engines, release=engine_groups):
                self._rebuild_needed = False
            raise

    # -- repair ----------------------------------------------------------------------------
    def repair_if_needed(self) -> None:
        """Before a call: replace dead or stuck engines and rebuild the process groups, if a
        fault left them so. Falls back to restarting every engine; raises LabError if even that fails."""
        engines = self.engines
        # the last call ended cleanly and no engine is marked: nothing to repair, no cost
        if not self._rebuild_needed and not engines.to_replace():
            return
        t0 = time.monotonic()
        note = {"replaced": {}, "restarted_all": None}
        try:
            # ranks still inside the last job first: cancelled, released, condemned if even that fails
            faults.free_stuck(engines)
            note["replaced"] = engines.to_replace()
            if note["replaced"]:
                engines.replace(sorted(note["replaced"]))
            # the torch world rebuilt, new engines included, on a fresh port
            engines.setup()
        except Exception as first:
            note["restarted_all"] = str(first)
            try:
                engines.restart()
            except Exception as e:
                raise LabError(
                    f"the Lab could not repair itself ({first}); restarting every engine failed too "
                    f"({e}). Close it (lab.close()) and start a new Lab"
                ) from e
        self._rebuild_needed = False
        note["seconds"] = time.monotonic() - t0
        self.repairs.append(note)

    def restart(self) -> None:
        """Replace every engine and rebuild the process groups (what the repair falls back to)."""
        with self.engines.lock:
            self.engines.restart()
            self._rebuild_needed = False
