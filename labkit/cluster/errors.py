"""The errors a Lab raises. ConfigError lives in labkit.config (the engines raise it too).

Each fault error is raised as soon as the fault is known (within the run's timeout plus the
moment it takes to read the ranks' logs and release the ranks that waited); whatever repair
the Lab still needs (replacing an engine, rebuilding the process groups on a fresh port) is
done at the start of the next call, which waits for it.
"""

from __future__ import annotations

from labkit.config import ConfigError  # noqa: F401  (re-exported)

READY = "the Lab repairs itself (engines, process groups) at the start of the next run"


class LabError(RuntimeError):
    """Base class for failures of a run on the cluster."""


class RankError(LabError):
    """An exception on one or more ranks; carries each rank's remote traceback.

    failures: rank -> {"host", "traceback"} of the ranks that raised on their own;
    released: ranks that were waiting for them (in a collective) and were freed."""

    def __init__(self, failures: dict[int, dict], released: list[int] | None = None):
        self.failures = failures
        self.released = sorted(released or [])
        first = min(failures)
        self.rank = first
        lines = [f"rank {r} on {f['host']} raised: {_last_line(f['traceback'])}" for r, f in sorted(failures.items())]
        freed = (
            f"ranks {self.released} were waiting for it and were released"
            if self.released
            else "no other rank was left waiting"
        )
        super().__init__(
            "\n".join(lines)
            + f"\n\n--- traceback of rank {first} ---\n"
            + failures[first]["traceback"].rstrip()
            + f"\n\n({freed}; {READY})"
        )


class ScriptFailed(RankError):
    """A script's process exited with a code other than 0 on some rank (lab.torchrun): the message is
    torchrun's summary (labkit/cluster/script/summary.py: the first failure, its traceback, the ranks
    stopped after it); `result` is the ScriptResult of what every rank did until then.

    failures: rank -> {"host", "traceback"} of the ranks that failed on their own; released: the ranks
    the Lab stopped; rank: the first failure's."""

    def __init__(self, text: str, *, failures: dict[int, dict], released: list[int], rank: int, result=None):
        self.failures, self.released, self.rank, self.result = failures, sorted(released), rank, result
        LabError.__init__(self, text)


class EngineDied(LabError):
    """An engine process went away (or stopped answering) during a run."""

    def __init__(self, rank: int, host: str, detail: str = "", ranks: list[int] | None = None):
        self.rank, self.host = rank, host
        self.ranks = sorted(ranks or [rank])
        also = f" (ranks {self.ranks} in all)" if len(self.ranks) > 1 else ""
        super().__init__(
            f"the engine of rank {rank} on host {host} died{also}" + (f": {detail}" if detail else "") + f"; {READY}"
        )


class CollectiveTimeout(LabError, TimeoutError):
    """A run did not finish within its timeout; the message is the hang diagnosis
    (labkit.cluster.diagnose.analyse: `analysis` holds it as data)."""

    def __init__(self, timeout: float, diagnosis: str, analysis: dict | None = None):
        self.timeout = timeout
        self.analysis = analysis or {}
        super().__init__(f"the run did not finish within {timeout:g} s.\n{diagnosis}\n({READY})")


class Cancelled(LabError):
    """The run was cancelled (Lab.cancel, or an interrupt in the notebook)."""


def _last_line(tb: str) -> str:
    lines = [ln for ln in (tb or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "?"
