"""Per-step progress of a run as the notebook shows it: the ranks' records combined into one line."""

from __future__ import annotations


def print_progress(p: dict) -> None:
    print(f"step {p['step'] + 1}/{p['steps']}  loss {p['loss']:.4f}  ({p['seconds']:.2f} s)", flush=True)


class StepProgress:
    """Combines the ranks' per-step records into one: {step, steps, loss (global), seconds}.

    Records that are not training steps (a user's apply may report anything) pass through."""

    def __init__(self, show):
        self.show = show
        self.pending: dict[int, list[dict]] = {}

    def add(self, rec: dict) -> None:
        if "loss_share" not in rec:
            if rec.get("rank", 0) == 0:
                self.show(rec)
            return
        got = self.pending.setdefault(rec["step"], [])
        got.append(rec)
        if len(got) == rec["ranks"]:
            del self.pending[rec["step"]]
            self.show(
                {
                    "step": rec["step"],
                    "steps": rec["steps"],
                    "loss": sum(r["loss_share"] for r in got) / rec["shards"],
                    "seconds": max(r["seconds"] for r in got),
                }
            )
