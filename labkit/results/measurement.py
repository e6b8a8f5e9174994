"""What Lab.measure measured: a user's function on every rank, with the views of a run.

A Measurement is a sibling of RunResult (both are RankViews, labkit/results/views.py): the same
RankReport per rank — memory by category, every collective as a CommEvent, the timeline — so
`comm_table()`, `memory_table()`, `trace()` / `save_trace()`, the figure builders and the
Dashboard's panels take either. What differs: no layout or losses (the user's code has its
own), and `values`, what fn returned on each rank.

Steps come from the tracked optimizer (engines/tracking.py): events before the first tracked
forward are set-up, step -1, left out of `comm_table()`'s default (the last step) like a run's
set-up; `comm_table(step=None)` sums every step, set-up included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.config.table import card
from labkit.results.run import RankReport, rank_report
from labkit.results.views import RankViews


@dataclass
class Measurement(RankViews):
    """One RankReport per rank (losses empty), the steps seen, fn's return value per rank."""

    ranks: list[RankReport]
    steps: int
    """Steps seen (at least 1): each tracked optimizer step ends one (engines/tracking.py)."""
    values: list = field(default_factory=list)
    """fn's return value on each rank, in rank order (modules, optimizers and meshes it returned
    are tracked instead and left out)."""
    wall_seconds: float = 0.0

    @classmethod
    def from_reports(cls, reports: list[dict], wall: float) -> Measurement:
        starts = [e["start"] + r["clock_offset"] for r in reports for e in r["timeline"]]
        starts += [e["start"] + r["clock_offset"] for r in reports for e in r["comm"]]
        t0 = min(starts) if starts else 0.0
        ranks = [rank_report(r, t0, losses=[], threads=r.get("threads", 0)) for r in reports]
        steps = max([1, *(r["steps"] for r in reports)])  # a run with no tracked step is one step of set-up
        return cls(ranks, steps, [r["value"] for r in reports], wall)

    @property
    def phases(self) -> list[str]:
        """The phases the collectives ran in (setup, forward, backward, optimizer, user)."""
        return sorted({e.phase for rk in self.ranks for e in rk.comm})

    def _repr_html_(self) -> str:
        dims = sorted({d for rk in self.ranks for d in rk.coords})
        facts = [
            ("measured", f"{len(self.ranks)} ranks, {self.steps} step(s) in {self.wall_seconds:.2f} s"),
            ("mesh", ", ".join(f"{d}={1 + max(rk.coords[d] for rk in self.ranks)}" for d in dims) or "none tracked"),
        ]
        more, tables = self._glance()
        return card("Measurement", facts + more, tables)
