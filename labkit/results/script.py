"""What lab.torchrun measured: a user's script on every rank, with the views of a run.

A ScriptResult is a Measurement (labkit/results/measurement.py; both RankViews): one RankReport per
rank — the script's collectives by its own groups (named by the dims of the meshes it built, else
'world' or the group's ranks), memory by category where its model and optimizer were found, the
timeline — so `comm_table()`, `trace()`, the figures and the Dashboard take it. What a script adds:
each rank's exit code, stdout and stderr, the peak resident memory of its process (`rss`: the total
whatever was found), the steps it trained (`steps_seen`: optimizer steps of a found or tracked
model; 0 where none was found), and the torchrun command it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.config.table import Rows, card, human_bytes
from labkit.results.measurement import Measurement


@dataclass
class ScriptResult(Measurement):
    """A Measurement of a script run under torchrun's contract (labkit/cluster/script/)."""

    command: str = ""
    """The torchrun command line the call stands for."""
    exit_codes: list[int | None] = field(default_factory=list)
    """Each rank's exit code (a negative one: killed by that signal; None: no report)."""
    stdout: list[str] = field(default_factory=list, repr=False)
    stderr: list[str] = field(default_factory=list, repr=False)
    """Each rank's output, its last engines/script/agent.py KEEP characters."""
    steps_seen: list[int] = field(default_factory=list)
    """Each rank's steps: a found or tracked model's forward to its optimizer's step."""
    rss: list[int] = field(default_factory=list)
    """Each rank's process at its largest, in bytes (its peak resident set: torch itself included)."""
    notes: list[list[str]] = field(default_factory=list)
    """Per rank, what the meters could not do (a find that failed, a report that never came)."""

    @classmethod
    def from_reports(cls, reports: list[dict], wall: float, command: str = "") -> ScriptResult:
        out = super().from_reports(reports, wall)
        out.command = command
        out.exit_codes = [r["exit_code"] for r in reports]
        out.stdout, out.stderr = [r["stdout"] for r in reports], [r["stderr"] for r in reports]
        out.steps_seen = [r["steps"] for r in reports]
        out.rss = [r["rss"] for r in reports]
        out.notes = [r["notes"] for r in reports]
        return out

    @property
    def ok(self) -> bool:
        """Whether every rank's script exited with 0."""
        return bool(self.exit_codes) and all(c == 0 for c in self.exit_codes)

    def memory_table(self) -> Rows:
        """One row per rank: bytes of each category found, and `rss`, the whole process's peak."""
        return Rows({**row, "rss": rss} for row, rss in zip(super().memory_table(), self.rss))

    def _repr_html_(self) -> str:
        codes = ", ".join(f"{r}: {c}" for r, c in enumerate(self.exit_codes))
        facts = [
            ("command", self.command),
            ("ranks", f"{len(self.ranks)}, exit codes {codes}, in {self.wall_seconds:.1f} s"),
            ("steps", ", ".join(map(str, self.steps_seen)) + " (per rank)"),
            ("process peak", ", ".join(human_bytes(b) for b in self.rss)),
        ]
        more, tables = self._glance()
        return card("ScriptResult", facts + more, tables)
