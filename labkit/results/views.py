"""The views every measured result shares: a run's (RunResult) and a user function's
(Measurement) alike hold one RankReport per rank and a number of steps, and from those come
the comm and memory tables, the bubble, the Chrome/Perfetto trace and the summary a notebook
shows. The figure builders (widgets/figures.py) and the Dashboard read these views only.
"""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from labkit.config.table import Rows, human_bytes

COMPUTE_KINDS = ("F", "B", "W")
STATES = ("params", "grads", "optimizer")


class RankViews:
    """Base of RunResult and Measurement: subclasses have `ranks` (list[RankReport]) and `steps`."""

    ranks: list
    steps: int

    def comm_table(self, step: int | None = -1) -> Rows:
        """Rows {rank, dim, op, calls, payload_bytes, wire_bytes} per rank x dim x op, for one
        step (default: the last — the steady state) or summed over all steps (step=None)."""
        wanted = None if step is None else (step % self.steps)
        acc: dict[tuple, dict] = {}
        for rk in self.ranks:
            for e in rk.comm:
                if wanted is not None and e.step != wanted:
                    continue
                row = acc.setdefault(
                    (rk.rank, e.dim, e.op),
                    {"rank": rk.rank, "dim": e.dim, "op": e.op, "calls": 0, "payload_bytes": 0, "wire_bytes": 0.0},
                )
                row["calls"] += 1
                row["payload_bytes"] += e.payload_bytes
                row["wire_bytes"] += e.wire_bytes
        # by (rank, dim, op), as the theory's Comm.table: measured and predicted rows line up one to one
        return Rows(acc[k] for k in sorted(acc))

    def memory_table(self) -> Rows:
        """One row per rank: bytes of each memory category."""
        return Rows({"rank": rk.rank, **rk.memory} for rk in self.ranks)

    def comm_per_dim(self, step: int | None = -1) -> Rows:
        """Rows {dim, op, calls, wire_bytes}: what the busiest rank of each dim x op sends (one step)."""
        best: dict[tuple, dict] = {}
        for row in self.comm_table(step):
            key = (row["dim"], row["op"])
            # the busiest rank of each dim and op: ranks of one dim may differ (a pipeline's end stages)
            if key not in best or row["wire_bytes"] > best[key]["wire_bytes"]:
                best[key] = {"dim": row["dim"], "op": row["op"], "calls": row["calls"], "wire_bytes": row["wire_bytes"]}
        return Rows(best[k] for k in sorted(best))

    def fullest(self):
        """The RankReport with the highest peak memory."""
        # a tie goes to the lowest rank
        return max(self.ranks, key=lambda rk: (rk.memory.get("peak", 0), -rk.rank))

    def bubble_fraction(self, step: int = -1) -> dict:
        """Idle fraction of each rank between the first and last compute span (F/B/W) of its
        pipeline in the step: {'per_rank': {rank: f}, 'overall': mean}. 0 without a pipeline
        (no rank with a pp coordinate above 0).

        This is what (p-1)/(m+p-1) means: the pipeline's step lasts (m+p-1)(t_F+t_B) from the
        first stage's first forward to its last backward, and each stage computes m(t_F+t_B) of
        it. The window is taken per pipeline (ranks that differ only in pp), since data-parallel
        replicas run their pipelines independently until the gradient reduction; time in
        send/recv counts as idle, as in the formula (which assumes free communication)."""
        wanted = step % self.steps
        spans = {rk.rank: [e for e in rk.timeline if e.kind in COMPUTE_KINDS and e.step == wanted] for rk in self.ranks}
        per = {r: 0.0 for r in spans}
        # no rank past pp 0: no pipeline, no bubble
        if any(rk.coords.get("pp", 0) > 0 for rk in self.ranks):
            pipelines: dict[tuple, list[int]] = defaultdict(list)
            for rk in self.ranks:
                # one pipeline: the ranks equal in every coordinate but pp
                pipelines[tuple(v for d, v in sorted(rk.coords.items()) if d != "pp")].append(rk.rank)
            for ranks in pipelines.values():
                everything = [e for r in ranks for e in spans[r]]
                if not everything:
                    continue
                t0 = min(e.start for e in everything)
                t1 = max(e.end for e in everything)
                for r in ranks:
                    # the window less the rank's own compute: time in send/recv counts as idle, as in the formula
                    per[r] = 1.0 - sum(e.end - e.start for e in spans[r]) / (t1 - t0)
        return {"per_rank": per, "overall": float(np.mean(list(per.values()))) if per else 0.0}

    # -- the trace ----------------------------------------------------------------------------
    def trace(self) -> dict:
        """Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev): one process per rank,
        compute and step spans on one track, communication on another."""
        events = []
        for rk in self.ranks:
            pid = rk.rank
            events.append(
                {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"rank {rk.rank} {rk.coords}"}}
            )
            events.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
            events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "comm"}})
            for e in rk.timeline:
                label = e.kind if e.microbatch is None else f"{e.kind}{e.microbatch}"
                events.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 0,
                        "name": label,
                        # microseconds, the trace format's unit
                        "ts": e.start * 1e6,
                        "dur": (e.end - e.start) * 1e6,
                        "args": {"microbatch": e.microbatch, "chunk": e.chunk, "step": e.step},
                    }
                )
            for c in rk.comm:
                # an op that never ended (a hang) is marked at its start with no length
                end = c.end if c.end is not None else c.start
                events.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 1,
                        "name": f"{c.op}[{c.dim}]",
                        "ts": c.start * 1e6,
                        "dur": (end - c.start) * 1e6,
                        "args": {
                            "group": c.group,
                            "numel": c.numel,
                            "dtype": c.dtype,
                            "wire_bytes": c.wire_bytes,
                            "phase": c.phase,
                            "seq": c.seq,
                        },
                    }
                )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.trace(), f)

    # -- what a notebook shows ------------------------------------------------------------------
    def _glance(self) -> tuple[list[tuple[str, str]], list[tuple[str, Rows]]]:
        """Facts and tables every result's card shows: the fullest rank's memory, comm per dim."""
        rk = self.fullest()
        mem = ", ".join(f"{k} {human_bytes(rk.memory.get(k, 0))}" for k in (*STATES, "activations", "peak"))
        facts = [(f"fullest rank ({rk.rank})", mem)]
        per_dim = Rows({**r, "sent": human_bytes(r["wire_bytes"])} for r in self.comm_per_dim())
        return facts, [("communication of the busiest rank per dim and op, one step (ring model)", per_dim)]
