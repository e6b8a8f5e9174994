"""A job's faults turned into errors, and the ranks left waiting released (the job runner's
fault paths, labkit/cluster/jobs.py). Every wait is bounded; each error is raised as soon as it is known.

  fault                          error               right away
  a rank raises                  RankError           release the ranks waiting on it
  a rank's script fails          RankError           stop every other rank's script (stop_group)
  no progress within timeout     CollectiveTimeout   read the logs, diagnose, release
  an engine dies / goes silent   EngineDied          release the others
  Ctrl-C, progress callback      (re-raised)         cancel, release
  Lab.cancel()                   Cancelled           (ranks stop at a boundary)

The functions hold no state: what they learn about engines (one to replace) they mark on the
EngineSet. How releasing works, and why a rank is sometimes replaced instead: ARCHITECTURE.md, "Faults".
"""

from __future__ import annotations

import re
import time

from labkit.cluster.diagnose import analyse
from labkit.cluster.engine_set import EngineGone, EngineSet
from labkit.cluster.errors import CollectiveTimeout, EngineDied, RankError
from labkit.engines import release, runtime, sockets

ERROR_GRACE_S = 0.5
"""After a first rank fails, how long other ranks may still fail on their own (the same bug on
every rank) before the rest are released; later failures are consequences, not causes."""
RELEASE_S = 3.0
"""How long the release cascade waits for the next rank to be over, from its start and again from each
release: each release frees the ranks that waited on the one released, and each round of it is three
calls on every engine, which a loaded machine slows (at half a 2-core machine's CPU, beside another
test worker, one rank raising took 2.6 s to release the other three, and once over 3 s: none was
released, and the next call had to repair them). A rank is released once, so the cascade ends within
(world + 1) x RELEASE_S."""
CANCEL_GRACE_S = runtime.LATE_S + 5.0
"""How long a cancelled job may take to stop: its ranks stop together at the next step boundary
(engines/runtime.py `stop_agreed`), or each at its next microbatch once that is LATE_S overdue, and
5 s for that microbatch to end."""
SETTLE_S = 2.0
"""Once one rank has stopped, how long the others may take to stop too before those still running are
taken to wait for it in a collective, and released. The ranks stop together, out of one all-reduce:
the rest is each job thread getting the CPU back to say so, 0.5 s not always enough on a loaded 2-core
machine beside another cluster."""
ALIVE_S = 0.5
"""At a timeout, how long the ranks' collective counts are watched to tell a run still going (they
advance: a TINY step makes dozens of collectives in that time) from a hang (none advances)."""
LOG_TAIL = 400
"""Collective-log entries read from each rank for a diagnosis."""

_COLLECTIVE_TIMEOUT = re.compile(
    r"Timed out waiting \d+ms for (recv|send)|Watchdog caught collective operation timeout"
)


# -- fault paths (each raises) ---------------------------------------------------------------
def on_error(engines: EngineSet, states: list[dict], timeout: float) -> None:
    """Some rank's job raised: RankError with every rank that failed on its own (EngineDied if
    an engine is gone, CollectiveTimeout if gloo's own timeout fired first)."""
    world = range(engines.world)
    failures = {r: s["error"] for r, s in enumerate(states) if s["state"] == "error"}
    end = time.monotonic() + ERROR_GRACE_S
    # a rank still running may be about to fail on its own (the same bug everywhere): a short grace
    while time.monotonic() < end and any(s["state"] == "running" for s in states):
        time.sleep(0.05)
        got = engines.each(runtime.poll, world, 10**9)
        states = [got[r] for r in world]
        failures.update({r: s["error"] for r, s in enumerate(states) if s["state"] == "error" and r not in failures})
    dead = engines.dead(world)
    if dead:  # the others' "connection closed" errors are the consequence
        raise EngineGone(dead, "its process is gone")
    if all(_COLLECTIVE_TIMEOUT.search(tb) for tb in failures.values()):
        on_timeout(engines, timeout)  # gloo's own timeout fired first: diagnose it as a hang
    final = release_cascade(engines)
    # ranks that failed only because the release cut their collective: named apart from the causes
    released = [r for r, s in final.items() if r not in failures and s["state"] == "error"]
    raise RankError({r: {"host": engines.hosts[r], "traceback": tb} for r, tb in failures.items()}, released)


def stop_group(engines: EngineSet, states: list[dict], timeout: float) -> None:
    """A rank's script failed: torchrun's rule, the agent stops the whole group. Every rank still
    running is cancelled (its engine's agent sends its script SIGTERM, then SIGKILL:
    engines/script/agent.py), waited for within CANCEL_GRACE_S, and RankError names every rank that
    failed on its own (`released`: those stopped). No engine collective was in use: nothing to release."""
    world = range(engines.world)
    failures = {r: s["error"] for r, s in enumerate(states) if s["state"] == "error"}
    running = [r for r, s in enumerate(states) if s["state"] == "running"]
    if running:
        engines.each(runtime.cancel, running)
    # failed before the stop reached it (its own error, or its peer's death seen by its collective)
    failures.update({r: s["error"] for r, s in stop_all(engines, running).items() if s["state"] == "error"})
    dead = engines.dead(world)
    if dead:
        raise EngineGone(dead, "its process is gone")
    stopped = [r for r in world if r not in failures]
    raise RankError({r: {"host": engines.hosts[r], "traceback": tb} for r, tb in failures.items()}, stopped)


def on_timeout(engines: EngineSet, timeout: float, steps_done: str = "", *, release: bool = True) -> None:
    """Not finished within the timeout: CollectiveTimeout with the diagnosis of the ranks' logs, or,
    when their collectives still advance, the word that the run is slow, not hung (steps_done: how far
    it got, e.g. "step 5,120 of 100,000"). release=False (a script's job, which never used the engines'
    groups): every rank is stopped instead of released (`stop_all`)."""
    # no progress records (all read), the last LOG_TAIL collective-log entries: what the diagnosis reads
    got = engines.each(runtime.poll, range(engines.world), 10**9, LOG_TAIL)
    found = analyse(got, dict(enumerate(engines.hosts)))
    advanced = _ops_advanced(engines, got)
    if advanced:
        # a run still going at its deadline: a rank caught inside some collective by the poll is not stuck
        # there, and blaming that collective sends the user looking for a hang that is not there
        found["text"] = (
            f"Not a hang: the ranks were still running ({advanced} more collectives entered in the "
            f"{ALIVE_S:g} s after the deadline{', ' + steps_done if steps_done else ''}). Give the call a "
            "longer timeout (timeout=...) or fewer steps."
        )
        found["running"] = advanced
    try:
        engines.each(runtime.cancel, range(engines.world))
        if not release:
            stop_all(engines)
        else:
            release_cascade(engines, bound=1.0)  # ranks waiting only on each other are freed by the groups' timeout
    except EngineGone as d:
        # an engine that does not answer the cancel is replaced at the next call
        engines.condemn(d.ranks, d.detail)
    raise CollectiveTimeout(timeout, found["text"], found)


def _ops_advanced(engines: EngineSet, first: dict) -> int:
    """How many more collectives the ranks entered ALIVE_S after `first` (polls with their groups'
    op counts): 0 for a hang, where every rank waits in one."""
    time.sleep(ALIVE_S)
    again = engines.each(runtime.poll, range(engines.world), 10**9, 1)

    def entered(poll: dict) -> int:
        return sum(n for n, _ in (poll.get("groups") or {}).values())

    return sum(max(0, entered(again[r]) - entered(first[r])) for r in first)


def stop_all(engines: EngineSet, ranks=None) -> dict:
    """Wait for cancelled ranks (default: every live one) to stop, within CANCEL_GRACE_S; those still
    running then are condemned. For jobs whose ranks hold no engine group (a script's): nothing waits
    on a peer's engine, so nothing is released. Returns the last states of `ranks`."""
    running = list(engines.live() if ranks is None else ranks)
    end, got = time.monotonic() + CANCEL_GRACE_S, {}
    while running and time.monotonic() < end:
        time.sleep(0.05)
        polled = engines.each(runtime.poll, running, 10**9)
        got.update(polled)
        running = [r for r in running if polled[r]["state"] == "running"]
    engines.condemn(running, "its job still ran after cancel (a script that did not stop after SIGKILL)")
    return got


def on_died(engines: EngineSet, gone: EngineGone) -> None:
    """Engines went away: EngineDied naming the first rank; the others are released."""
    engines.condemn(gone.ranks, gone.detail)
    try:
        release_cascade(engines)
    # best effort: the error to raise is the death, whatever the release runs into
    except Exception:
        pass
    first = gone.ranks[0]
    raise EngineDied(first, engines.hosts[first], gone.detail, gone.ranks)


# -- stopping a job ---------------------------------------------------------------------------
def abandon(engines: EngineSet, *, release: bool = True) -> bool:
    """The call is leaving early (Ctrl-C, a progress callback raised): stop the job everywhere.
    Best effort and bounded; whatever is left is repaired at the next call. Returns whether the
    process groups can be kept (see stop_after_cancel). release=False: a script's job, whose ranks
    are stopped and nothing released (`stop_all`)."""
    try:
        # live engines only: a dead one would raise EngineGone before anything is cancelled
        engines.each(runtime.cancel, engines.live(), bound=5.0)
        if not release:
            stop_all(engines)
            return True
        return stop_after_cancel(engines)
    except EngineGone as d:
        engines.condemn(d.ranks, d.detail)
    except BaseException:  # a second Ctrl-C: leave the rest to the repair
        pass
    return False


def stop_after_cancel(engines: EngineSet) -> bool:
    """Wait for the cancelled job to stop on every rank (at most CANCEL_GRACE_S, and SETTLE_S
    after the first rank stopped). Returns True if the ranks stopped in step, so the process
    groups can be kept; else releases whoever still waits and returns False."""
    end, first_stop = time.monotonic() + CANCEL_GRACE_S, None
    while time.monotonic() < end:
        got = engines.each(runtime.poll, engines.live(), 10**9, LOG_TAIL)
        running = [r for r, s in got.items() if s["state"] == "running"]
        if not running:
            # every rank answered and no group was left half-entered: the groups can be kept
            if len(got) == engines.world and consistent(got):
                return True
            break
        # some stopped, some still run: those may be waiting on a stopped one inside a collective
        if len(running) < len(got):
            first_stop = first_stop or time.monotonic()
            if time.monotonic() - first_stop > SETTLE_S:
                break
        time.sleep(0.05)
    release_cascade(engines)
    return False


def free_stuck(engines: EngineSet) -> None:
    """Before a repair: ranks still running a job are cancelled and released; those still
    running after that are condemned (their engines are replaced)."""
    try:
        got = engines.each(runtime.poll, engines.live(), 10**9)
    except EngineGone as d:
        engines.condemn(d.ranks, d.detail)
        # again without the condemned engines, which live() no longer lists
        return free_stuck(engines)
    running = [r for r, s in got.items() if s["state"] == "running"]
    if not running:
        return
    engines.each(runtime.cancel, running)
    final = release_cascade(engines, CANCEL_GRACE_S)
    engines.condemn(
        [r for r, s in final.items() if s["state"] == "running"], "its job still ran after cancel and release"
    )


# -- releasing --------------------------------------------------------------------------------
def release_cascade(engines: EngineSet, bound: float = RELEASE_S) -> dict:
    """Release every rank whose job is over (engines/release.py), until no rank is left waiting
    or `bound` passes with no rank released (RELEASE_S): each release frees the ranks that waited on
    it, whose jobs then end too. On NCCL every live rank at once, its communicators aborted. Returns
    the ranks' last states."""
    end = time.monotonic() + bound
    released: set[int] = set()
    got: dict = {}
    # on NCCL a rank waiting in a collective waits in a GPU kernel that no socket reaches: every live rank's
    # communicators are aborted at once, its job running or not (engines/release.py `route`)
    abort = engines.backend == "nccl"
    while True:
        live = engines.live()
        try:
            got = engines.each(runtime.poll, live, 10**9)
            over = [r for r in live if (abort or got[r]["state"] != "running") and r not in released]
            if over:
                # every engine's own listening endpoints: a release shuts its torch connections to them, since
                # destroying the groups alone leaves gloo's open under PyTorch's DDP (ARCHITECTURE.md, "Faults")
                peers = sorted({ep for eps in engines.each(sockets.listening, live).values() for ep in eps})
                for r, out in engines.each(release.release, over, peers, abort).items():
                    # torch still holds its groups: a new engine at the next call, so that no port leaks
                    if out["held"]:
                        engines.taint(
                            r,
                            f"torch still held its old process groups ({out['held']} "
                            "listening sockets): a new engine frees them",
                        )
                released |= set(over)
                end = max(end, time.monotonic() + bound)  # the ranks it freed get their own `bound`
        except EngineGone as d:
            engines.condemn(d.ranks, d.detail)
            # polled again without the engine that went away
            continue
        if all(s["state"] != "running" for s in got.values()) or time.monotonic() > end:
            return got
        time.sleep(0.05)


def consistent(polls: dict[int, dict]) -> bool:
    """Whether the ranks stopped in step: no op left open, and every process group's members
    entered the same number of ops (then the groups can be used again as they are)."""
    counts: dict[tuple, dict[int, int]] = {}
    for r, p in polls.items():
        if p.get("open"):
            return False
        for pg, (n, ranks) in (p.get("groups") or {}).items():
            counts.setdefault((pg, tuple(ranks)), {})[r] = n
    for (_, ranks), per in counts.items():
        # one member entered more ops than a peer: that peer was left waiting in a collective
        if len({per.get(m, 0) for m in ranks if m in polls}) > 1:
            return False
    return True
