"""The errors a Lab raises. ConfigError lives in labkit.config (the engines raise it too)."""
from __future__ import annotations

from labkit.config import ConfigError  # noqa: F401  (re-exported)


class LabError(RuntimeError):
    """Base class for failures of a run on the cluster."""


class RankError(LabError):
    """An exception on one or more ranks; carries each rank's remote traceback."""

    def __init__(self, failures: dict[int, dict]):
        self.failures = failures   # rank -> {"host": .., "traceback": ..}
        first = min(failures)
        lines = [f"rank {r} on {f['host']} raised:" for r, f in sorted(failures.items())]
        super().__init__("\n".join(lines) + f"\n\n--- traceback of rank {first} ---\n"
                         + failures[first]["traceback"].rstrip()
                         + "\n\n(the other ranks were released; the Lab is ready for the next run)")


class EngineDied(LabError):
    """An engine process went away during a run."""

    def __init__(self, rank: int, host: str, detail: str = ""):
        self.rank, self.host = rank, host
        super().__init__(f"the engine of rank {rank} on host {host} died"
                         + (f": {detail}" if detail else "")
                         + "; the Lab restarted its engines and is ready for the next run")


class CollectiveTimeout(LabError, TimeoutError):
    """A run did not finish within its timeout; the message is the hang diagnosis."""

    def __init__(self, timeout: float, diagnosis: str, analysis: dict | None = None):
        self.timeout = timeout
        self.analysis = analysis or {}
        super().__init__(f"the run did not finish within {timeout:g} s.\n{diagnosis}")


class Cancelled(LabError):
    """The run was cancelled (Lab.cancel, or an interrupt in the notebook)."""
