"""Predicted collectives, accumulated as rows like the comm meter's: {rank, dim, op, calls,
payload_bytes, wire_bytes}, wire bytes by the ring model (labkit/layout/wire.py). Each strategy's
theory adds its ops to a `Comm`; theory/exact/per_rank.py gathers them for one step."""

from __future__ import annotations

from collections.abc import Callable

from labkit.layout.wire import WIRE


class Stopped(Exception):
    """The caller's `stop()` turned true while rows were being added (the walk was abandoned)."""


class Comm:
    """Accumulates predicted ops as rows {rank, dim, op, calls, payload_bytes, wire_bytes}.

    `only`: the ranks to fill (theory modules loop over `comm.ranks(layout)`); the estimate at
    scale fills one representative rank per class and copies its rows to the others.
    `stop`: checked before each addition; once it returns True, adding raises `Stopped` (a
    widget abandons a long walk for a layout it no longer shows)."""

    def __init__(self, only: list[int] | None = None, stop: Callable[[], bool] | None = None):
        self.rows: dict[tuple, dict] = {}
        self.only = only
        self.stop = stop

    def ranks(self, layout) -> list[int] | range:
        return range(layout.world) if self.only is None else self.only

    def _row(self, rank: int, dim: str, op: str) -> dict:
        return self.rows.setdefault(
            (rank, dim, op), {"rank": rank, "dim": dim, "op": op, "calls": 0, "payload_bytes": 0, "wire_bytes": 0.0}
        )

    def add(self, rank: int, dim: str, op: str, payload: int, n: int, calls: int = 1) -> None:
        if self.stop is not None and self.stop():
            raise Stopped()
        if n <= 1 or calls <= 0:
            return
        row = self._row(rank, dim, op)
        wire = WIRE[op](payload, n)
        if calls > 64:  # at scale (thousands of calls): one multiplication
            row["calls"] += calls
            row["payload_bytes"] += payload * calls
            row["wire_bytes"] += wire * calls
            return
        for _ in range(calls):  # summed call by call, as the meter does, so the floats agree exactly
            row["calls"] += 1
            row["payload_bytes"] += payload
            row["wire_bytes"] += wire

    def per_stage(self, layout, ops_of) -> None:
        """Rows that depend only on a rank's pipeline coordinate: `ops_of(pp_rank)` gives
        (dim, op, payload bytes, group size, calls) tuples, summed once per coordinate and added
        to each of its ranks (the splits are even, so those ranks issue the same collectives)."""
        done: dict[int, list[dict]] = {}
        for rank in self.ranks(layout):
            pp_rank = layout.coords(rank)["pp"]
            if pp_rank not in done:
                # summed once, in a Comm of its own: every rank of the coordinate then gets the same floats
                stage = Comm()
                for dim, op, payload, n, calls in ops_of(pp_rank):
                    stage.add(0, dim, op, payload, n, calls)
                done[pp_rank] = stage.table()
            self.add_rows(rank, done[pp_rank])

    def add_rows(self, rank: int, rows: list[dict]) -> None:
        """Add rows summed elsewhere (the same for every rank at one pipeline coordinate) to `rank`."""
        if self.stop is not None and self.stop():
            raise Stopped()
        for r in rows:
            row = self._row(rank, r["dim"], r["op"])
            row["calls"] += r["calls"]
            row["payload_bytes"] += r["payload_bytes"]
            row["wire_bytes"] += r["wire_bytes"]

    def table(self) -> list[dict]:
        # by (rank, dim, op): tables and tests read the rows in one order, whatever order they came in
        return [self.rows[k] for k in sorted(self.rows)]
