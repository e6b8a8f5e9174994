"""A script's output in the notebook as it comes, and its steps on a bar: what torchrun's console
shows, each line with its rank (as `torchrun --tee 3 --log-lines-prefix-template '[rank${rank}]:'`).

Each rank's engine sends every line its script writes as a progress record {rank, stream, text,
redrawn} (engines/script/agent.py; `redrawn`: ended by '\\r', a progress bar drawn over itself) and
each step the Tracker closes as {step, rank, seconds}. Lines are printed on the notebook's stdout
or stderr as the script wrote them, for the ranks `echo` names; a redrawn line is not printed but
shown beside the bar (a notebook only: on a terminal the lines are the progress). The bar counts the
steps every rank has finished.
"""

from __future__ import annotations

import sys

from labkit.cluster import progress as bars


class ScriptProgress:
    """What the job runner feeds with the ranks' records (its `steps`: add, reached)."""

    def __init__(self, world: int, *, echo, progress, label: str):
        self.ranks = set(range(world)) if echo is True else set() if echo is False else set(echo)
        self.callback = progress if callable(progress) else None
        shown = progress not in (False, None) and self.callback is None and bars.in_kernel()
        self.bar = bars.WidgetBar(None, label) if shown else None
        self.steps = [0] * world
        self.note = ""

    def add(self, rec: dict) -> None:
        rank = rec.get("rank", 0)
        if "text" in rec:
            if rank in self.ranks and not rec["redrawn"]:
                stream = sys.stderr if rec["stream"] == "stderr" else sys.stdout
                print(f"[rank{rank}]:{rec['text']}", file=stream, flush=True)
            if rank == min(self.ranks or {0}):
                self.note = rec["text"].strip()[-80:]
        elif "step" in rec:
            self.steps[rank] = rec["step"] + 1
        if self.callback is not None:
            self.callback(rec)
        if self.bar is not None:
            self.bar.update(0, f"{self.reached() or 'starting'} · {self.note}")

    def reached(self) -> str:
        """How far every rank got, in words ("" before a step)."""
        done = min(self.steps)
        return f"step {done} done on every rank" if done else ""

    def close(self, ok: bool, note: str = "") -> None:
        if self.bar is not None:
            self.bar.close(note or self.reached() or "done", ok=ok)
