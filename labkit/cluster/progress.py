"""Progress as a person expects it: one bar that updates in place — a widget in a notebook, a
text bar on a terminal — and nothing where nobody watches (tests, logs).

A Lab's `progress` chooses: 'auto' (the default: a bar in a notebook or on a terminal, silent
otherwise), True (a bar wherever it runs: text outside a notebook), False (silent), or a
function of one record (the Dashboard's own bar). The ranks' per-step records are combined
into one (StepProgress) before they reach a bar; `shown` wires one call's records to what the
setting chose.
"""

from __future__ import annotations

import contextlib
import html
import sys
import time


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (IPython already loaded and a kernel attached)."""
    ipython = sys.modules.get("IPython")  # not imported here: outside IPython there is no kernel
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return getattr(shell, "kernel", None) is not None


def bar(progress, total: int | None, label: str):
    """A bar for this Lab setting (see the module docstring), or None: silent."""
    if progress is False or progress is None or callable(progress):
        return None
    # in a notebook a widget whatever was asked: the cell keeps one bar, updated in place
    if in_kernel():
        return WidgetBar(total, label)
    # 'auto' on a terminal only: a log or a test's captured output gets no bar
    if progress is True or sys.stderr.isatty():
        return TextBar(total, label)
    return None


@contextlib.contextmanager
def shown(progress, total: int | None, label: str):
    """Yields the StepProgress one call feeds with the ranks' records, shown as a Lab's `progress`
    says (the module docstring): a function gets each combined record; a bar of `total` steps
    (None: a count) called `label` ends with the last record's note, or with the error's name.
    Where nothing is shown it is fed all the same, silent."""
    if callable(progress):
        yield StepProgress(progress)
        return
    line = bar(progress, total, label)
    if line is None:  # combined all the same: a timeout says how far the run got
        yield StepProgress(lambda rec: None)
        return
    last: dict = {}

    def step(p: dict) -> None:
        last.update(p)
        line.update(p["step"] + 1 if "step" in p else 0, step_note(p))

    try:
        yield StepProgress(step)
    except BaseException as e:
        line.close(f"{type(e).__name__}", ok=False)
        raise
    line.close(f"done{': ' + step_note(last) if last else ''}")


class TextBar:
    """`label [#######.......] 2/3  note`, rewritten in place on stderr (a carriage return)."""

    WIDTH = 24

    def __init__(self, total: int | None, label: str, stream=None):
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self._last = 0
        self.update(0)

    def _line(self, value: int, note: str) -> str:
        if self.total:
            full = round(self.WIDTH * min(value, self.total) / self.total)
            count = f"{value}/{self.total}"
        else:
            full, count = self.WIDTH if value else 0, str(value)
        return f"{self.label} [{'#' * full}{'.' * (self.WIDTH - full)}] {count}  {note}"

    def update(self, value: int, note: str = "") -> None:
        line = self._line(value, note)
        # spaces over what a longer previous line left behind the new one
        self.stream.write("\r" + line + " " * max(0, self._last - len(line)))
        self.stream.flush()
        self._last = len(line)

    def close(self, note: str = "", ok: bool = True) -> None:
        value = self.total if ok and self.total else 0
        self.update(value, f"{note} ({time.perf_counter() - self.t0:.1f} s)")
        self.stream.write("\n")
        self.stream.flush()


class WidgetBar:
    """An ipywidgets progress bar and a note beside it, displayed once and updated in place."""

    def __init__(self, total: int | None, label: str):
        import ipywidgets as W  # deferred: the kernel's widgets, only where a bar is shown
        from IPython.display import display

        self.total = total
        self.t0 = time.perf_counter()
        self.bar = W.IntProgress(
            value=0,
            min=0,
            max=max(total or 1, 1),
            description=label,
            bar_style="info",
            style={"description_width": "initial"},
            layout=W.Layout(width="320px"),
        )
        self.note = W.HTML()
        self.widget = W.HBox([self.bar, self.note]).add_class("labkit-progress")
        display(self.widget)

    def update(self, value: int, note: str = "") -> None:
        self.bar.value = min(value, self.bar.max) if self.total else 0
        self.note.value = f"<span style='margin-left:8px'>{html.escape(note)}</span>"

    def close(self, note: str = "", ok: bool = True) -> None:
        self.bar.value = self.bar.max if ok else self.bar.value
        self.bar.bar_style = "success" if ok else "danger"
        self.update(self.bar.value if self.total else 0, f"{note} ({time.perf_counter() - self.t0:.1f} s)")


def step_note(p: dict) -> str:
    """What a bar says about a record: a combined training step, or a user's fields."""
    if "loss" in p and "seconds" in p:
        return f"loss {p['loss']:.4f} · {p['seconds']:.2f} s/step"
    if "step" in p and "seconds" in p:  # a measured step (engines/tracking.py)
        return f"step {p['step'] + 1} · {p['seconds']:.2f} s"
    return " · ".join(f"{k} {v}" for k, v in p.items() if k != "rank")


class StepProgress:
    """Combines the ranks' per-step records into one: {step, steps, loss (global), seconds}.

    Records that are not training steps (a user's apply may report anything) pass through."""

    def __init__(self, show):
        self.show = show
        self.pending: dict[int, list[dict]] = {}
        self.last: dict | None = None
        """The last step every rank reported (what a timeout says the run reached)."""

    def reached(self) -> str:
        """How far the run got, in words ("" before its first step)."""
        if self.last is None:
            return ""
        return f"step {self.last['step'] + 1:,} of {self.last['steps']:,} done"

    def add(self, rec: dict) -> None:
        if "loss_share" not in rec:
            # a user's records come from every rank: rank 0's stand for them
            if rec.get("rank", 0) == 0:
                self.show(rec)
            return
        got = self.pending.setdefault(rec["step"], [])
        got.append(rec)
        # shown once every rank reported the step: a loss summed from some ranks would be wrong
        if len(got) == rec["ranks"]:
            del self.pending[rec["step"]]
            self.last = rec
            self.show(
                {
                    "step": rec["step"],
                    "steps": rec["steps"],
                    "loss": sum(r["loss_share"] for r in got) / rec["shards"],
                    # the slowest rank's: a step ends when every rank has ended it
                    "seconds": max(r["seconds"] for r in got),
                }
            )
