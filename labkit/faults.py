"""How the Lab turns faults into errors and repairs itself (the half of Lab that is not set-up).

The rule: every wait has a bound, every fault becomes one clear error as soon as it is known,
and the repair waits for the next call.

  fault                          error               right away                   at the next call
  a rank raises                  RankError           release the ranks waiting    rebuild the groups
  no progress within timeout     CollectiveTimeout   read logs, diagnose, release rebuild; replace
                                                                                  engines still stuck
  an engine dies / goes silent   EngineDied          release the others           replace it, rebuild
  Ctrl-C, progress callback      (re-raised)         cancel, release              rebuild if needed
  Lab.cancel()                   Cancelled           (ranks stop at a boundary)   rebuild if needed

Releasing (engines/release.py): a rank whose job is over destroys its process groups and
shuts its torch connections, and every rank waiting on it in a collective gets an error at
once; repeated until no rank waits (a cascade). A rank whose groups torch still holds after
that (PyTorch's DDP pins them) gets a new engine at the next call, so no port leaks. Ranks that wait only on each other (a cycle)
are freed by the groups' own timeout, set per job just above the Lab's; one still running at
the next call is replaced (killed and started afresh: a thread inside a gloo collective cannot
be stopped from Python). Rebuilding: a new TCPStore on a port the OS picks, new groups.
"""
from __future__ import annotations

import os
import re
import signal
import time

from labkit.diagnose import analyse
from labkit.engines import release, runtime
from labkit.errors import CollectiveTimeout, EngineDied, LabError, RankError

ANSWER_S = 20.0
"""An engine that does not answer a poll within this long is taken for dead (its job runs in a
thread, so a live engine answers within milliseconds even mid-step)."""
ERROR_GRACE_S = 0.5
"""After a first rank fails, how long other ranks may still fail on their own (the same bug on
every rank) before the rest are released; later failures are consequences, not causes."""
RELEASE_S = 3.0
"""Bound on the release cascade."""
CANCEL_GRACE_S = 5.0
"""How long a cancelled job may take to reach its next step or microbatch boundary."""
SETTLE_S = 0.5
"""Once one rank has stopped, how long the others may take to stop too before those still
running are taken to wait for it in a collective, and released."""
LOG_TAIL = 400
"""Collective-log entries read from each rank for a diagnosis."""
REPLACE_WAIT_S = 120.0

_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms for (recv|send)|Watchdog caught collective operation timeout")


class _Died(Exception):
    """Internal: ranks whose engine is gone (or silent); becomes EngineDied."""

    def __init__(self, ranks, detail: str):
        self.ranks, self.detail = sorted(ranks), detail
        super().__init__(detail)


class FaultHandling:
    """Mixed into Lab: bounded waits on engines, the fault paths, and the repair."""

    _answer_s = ANSWER_S

    # -- bounded waits ---------------------------------------------------------------------
    def _gather(self, pending: dict, bound: float, watch: bool = True) -> dict:
        """rank -> result of each AsyncResult, waiting at most `bound` seconds. Raises _Died for
        ranks whose engine is gone (checked while waiting) or that do not answer in time."""
        import ipyparallel as ipp

        pending, out = dict(pending), {}
        deadline = time.monotonic() + bound
        while True:
            for r in [r for r, ar in pending.items() if ar.ready()]:
                try:
                    out[r] = pending.pop(r).get(0)
                except ipp.error.EngineError as e:
                    raise _Died([r], str(e).splitlines()[0] if str(e) else "its engine went away") from None
            if not pending:
                return out
            if watch:
                dead = self._dead(pending)
                if dead:
                    raise _Died(dead, "its process is gone")
            if time.monotonic() > deadline:
                raise _Died(list(pending), f"it did not answer within {bound:g} s")
            next(iter(pending.values())).wait(0.05)

    def _dead(self, ranks) -> list[int]:
        """Ranks among `ranks` whose engine process is gone (local: by pid; remote: unregistered)."""
        if not self.local:
            ids = set(self.client.ids)
            return [r for r in ranks if self.ids[r] not in ids]
        import psutil

        out = []
        for r in ranks:
            try:
                if psutil.Process(self.pids[r]).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    out.append(r)
            except psutil.NoSuchProcess:
                out.append(r)
        return out

    def _each(self, fn, ranks, *args, bound: float | None = None) -> dict:
        """fn(*args) on the engines of `ranks`; rank -> result (bounded, see _gather)."""
        return self._gather({r: self._send(r, fn, *args) for r in ranks}, bound or self._answer_s)

    def _send(self, rank: int, fn, *args):
        try:
            return self.client[self.ids[rank]].apply_async(fn, *args)
        except IndexError:   # the controller has already unregistered this engine
            raise _Died([rank], "its engine is no longer registered with the controller") from None

    def _mark(self, ranks, why: str) -> None:
        for r in ranks:
            self._replace.setdefault(r, why)

    def _live(self) -> list[int]:
        return [r for r in range(self.world) if r not in self._replace]

    # -- fault paths (each raises) -----------------------------------------------------------
    def _on_error(self, states: list[dict], timeout: float) -> None:
        failures = {r: s["error"] for r, s in enumerate(states) if s["state"] == "error"}
        end = time.monotonic() + ERROR_GRACE_S
        while time.monotonic() < end and any(s["state"] == "running" for s in states):
            time.sleep(0.05)
            got = self._each(runtime.poll, range(self.world), 10**9)
            states = [got[r] for r in range(self.world)]
            failures.update({r: s["error"] for r, s in enumerate(states) if s["state"] == "error" and r not in failures})
        dead = self._dead(range(self.world))
        if dead:          # the others' "connection closed" errors are the consequence
            raise _Died(dead, "its process is gone")
        if all(_COLLECTIVE_TIMEOUT.search(tb) for tb in failures.values()):
            self._on_timeout(timeout)   # gloo's own timeout fired first: diagnose it as a hang
        final = self._release()
        released = [r for r, s in final.items() if r not in failures and s["state"] == "error"]
        raise RankError({r: {"host": self.hosts[r], "traceback": tb} for r, tb in failures.items()}, released)

    def _on_timeout(self, timeout: float) -> None:
        got = self._each(runtime.poll, range(self.world), 10**9, LOG_TAIL)
        found = analyse(got, dict(enumerate(self.hosts)))
        try:
            self._each(runtime.cancel, range(self.world))
            self._release(bound=1.0)   # ranks waiting only on each other are freed by the groups' timeout
        except _Died as d:
            self._mark(d.ranks, d.detail)
        raise CollectiveTimeout(timeout, found["text"], found)

    def _on_died(self, died: _Died) -> None:
        self._mark(died.ranks, died.detail)
        try:
            self._release()
        except Exception:
            pass
        first = died.ranks[0]
        raise EngineDied(first, self.hosts[first], died.detail, died.ranks)


    def _abandon(self) -> None:
        """The call is leaving early (Ctrl-C, a progress callback raised): stop the job everywhere.
        Best effort and bounded; whatever is left is repaired at the next call."""
        try:
            self._each(runtime.cancel, self._live(), bound=5.0)
            self._stop_after_cancel()
        except _Died as d:
            self._mark(d.ranks, d.detail)
        except BaseException:   # a second Ctrl-C: leave the rest to the repair
            pass

    def _stop_after_cancel(self) -> None:
        """Wait for the cancelled job to stop on every rank (at most CANCEL_GRACE_S, and SETTLE_S
        after the first rank stopped); keep the process groups if the ranks stopped in step,
        else release whoever still waits."""
        end, first_stop = time.monotonic() + CANCEL_GRACE_S, None
        while time.monotonic() < end:
            got = self._each(runtime.poll, self._live(), 10**9, LOG_TAIL)
            running = [r for r, s in got.items() if s["state"] == "running"]
            if not running:
                if len(got) == self.world and _consistent(got):
                    self._rebuild_needed = False
                    return
                break
            if len(running) < len(got):
                first_stop = first_stop or time.monotonic()
                if time.monotonic() - first_stop > SETTLE_S:
                    break
            time.sleep(0.05)
        self._release()

    def _release(self, bound: float = RELEASE_S) -> dict:
        """Destroy the process groups of every rank whose job is over, until no rank is left
        waiting or `bound` passes (release.release). Returns the ranks' last states."""
        end = time.monotonic() + bound
        released: set[int] = set()
        got: dict = {}
        while True:
            live = self._live()
            try:
                got = self._each(runtime.poll, live, 10**9)
                over = [r for r in live if got[r]["state"] != "running" and r not in released]
                if over:
                    peers = sorted({ep for eps in self._each(release.listening, live).values() for ep in eps})
                    for r, out in self._each(release.release, over, peers).items():
                        if out["held"]:
                            self._tainted[r] = (f"torch still held its old process groups ({out['held']} "
                                                "listening sockets): a new engine frees them")
                    released |= set(over)
            except _Died as d:
                self._mark(d.ranks, d.detail)
                continue
            if all(s["state"] != "running" for s in got.values()) or time.monotonic() > end:
                return got
            time.sleep(0.05)

    # -- repair ----------------------------------------------------------------------------
    def _repair_if_needed(self) -> None:
        """Before a call: replace dead or stuck engines and rebuild the process groups, if a
        fault left them so. Falls back to restarting every engine; raises LabError if even that fails."""
        if not self._rebuild_needed and not self._replace and not self._tainted:
            return
        t0 = time.monotonic()
        note = {"replaced": {}, "restarted_all": None}
        try:
            self._free_stuck()
            for r, why in self._tainted.items():
                self._replace.setdefault(r, why)
            self._tainted.clear()
            if self._replace:
                note["replaced"] = dict(sorted(self._replace.items()))
                self._replace_engines(sorted(self._replace))
            self._setup()
        except Exception as first:
            note["restarted_all"] = str(first)
            try:
                self._restart_all()
            except Exception as e:
                raise LabError(f"the Lab could not repair itself ({first}); restarting every engine failed too "
                               f"({e}). Close it (lab.close()) and start a new Lab") from e
        self._replace.clear()
        self._rebuild_needed = False
        note["seconds"] = time.monotonic() - t0
        self.repairs.append(note)

    def _free_stuck(self) -> None:
        """Ranks still running a job: cancel, release; those still running are to be replaced."""
        try:
            got = self._each(runtime.poll, self._live(), 10**9)
        except _Died as d:
            self._mark(d.ranks, d.detail)
            return self._free_stuck()
        running = [r for r, s in got.items() if s["state"] == "running"]
        if not running:
            return
        self._each(runtime.cancel, running)
        final = self._release(CANCEL_GRACE_S)
        self._mark([r for r, s in final.items() if s["state"] == "running"], "its job still ran after cancel and release")

    def _replace_engines(self, ranks: list[int]) -> None:
        """Kill the engines of `ranks` and start new ones in their places (local clusters)."""
        if not self.local or self.cluster is None:
            raise LabError(f"the engines of ranks {ranks} must be restarted, and this Lab is connected to a cluster "
                           "it did not start: restart them with ipcluster and call Lab.connect again")
        import psutil

        procs = []
        for r in ranks:
            try:
                os.kill(self.pids[r], signal.SIGKILL)
                procs.append(psutil.Process(self.pids[r]))
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        psutil.wait_procs(procs, timeout=10)
        self.cluster.start_engines_sync(n=len(ranks))
        fresh = self._new_engines(len(ranks))
        for r, eid in zip(ranks, fresh):
            self.ids[r] = eid

    def _new_engines(self, n: int) -> list[int]:
        end = time.monotonic() + REPLACE_WAIT_S
        while time.monotonic() < end:
            fresh = sorted(set(self.client.ids) - self._known_ids)
            if len(fresh) >= n:
                self._known_ids |= set(fresh)
                return fresh[:n]
            time.sleep(0.1)
        raise LabError(f"{n} new engine(s) did not register within {REPLACE_WAIT_S:g} s")

    def restart(self) -> None:
        """Replace every engine and rebuild the process groups (what the repair falls back to)."""
        with self._lock:
            self._restart_all()
            self._replace.clear()
            self._rebuild_needed = False

    def _restart_all(self) -> None:
        if not self.local or self.cluster is None:
            raise LabError("this Lab is connected to a cluster it did not start; restart its engines "
                           "with ipcluster and call Lab.connect again")
        for pid in getattr(self, "pids", []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cluster.stop_engines_sync()
        self.cluster.start_engines_sync(n=self._n)
        self.ids = self._new_engines(self._n)
        self._setup()


def _consistent(polls: dict[int, dict]) -> bool:
    """Whether the ranks stopped in step: no op left open, and every process group's members
    entered the same number of ops (then the groups can be used again as they are)."""
    counts: dict[tuple, dict[int, int]] = {}
    for r, p in polls.items():
        if p.get("open"):
            return False
        for pg, (n, ranks) in (p.get("groups") or {}).items():
            counts.setdefault((pg, tuple(ranks)), {})[r] = n
    for (pg, ranks), per in counts.items():
        if len({per.get(m, 0) for m in ranks if m in polls}) > 1:
            return False
    return True
