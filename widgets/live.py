"""Showing a new go.Figure in an existing go.FigureWidget, in place and as one batch.

The widgets never rebuild their FigureWidgets: a notebook output keeps pointing at the same
object, and the browser receives one batch of changes (`batch_update`) per figure. Only the
properties that changed are set: plotly validates every property it is given, and on a
redraw most of a figure (its style, axes, colours) is what it was.
"""

from __future__ import annotations

import collections
import threading
from copy import deepcopy

import numpy as np
import plotly.graph_objects as go


def same(a, b) -> bool:
    """Deep equality of plotly JSON values (dicts, lists, tuples, numpy arrays, scalars)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return np.array_equal(np.asarray(a), np.asarray(b))
        except (TypeError, ValueError):
            return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _changes(old: dict, new: dict) -> tuple[dict, list[str]]:
    """Top-level keys of `new` whose values differ from `old`'s, and keys only `old` has."""
    return ({k: v for k, v in new.items() if k not in old or not same(old[k], v)}, [k for k in old if k not in new])


def _lines_up(old, new) -> bool:
    """Same number of traces, of the same types and names: restyle in place."""
    return len(old) == len(new) and all(a.type == b.type and a.name == b.name for a, b in zip(old, new))


def refresh(fw: go.FigureWidget, fig: go.Figure, **layout) -> None:
    """Make `fw` show `fig` (then apply `layout` overrides, e.g. a fixed height)."""
    new_layout = fig.layout.to_plotly_json()
    new_layout.update(layout)
    with fw.batch_update():
        if _lines_up(fw.data, fig.data):
            for old, new in zip(fw.data, fig.data):
                changed, gone = _changes(old.to_plotly_json(), new.to_plotly_json())
                for k in gone:
                    if k not in ("type", "uid"):
                        old[k] = None
                if changed:
                    old.update(changed, overwrite=True)
        else:
            fw.data = ()
            fw.add_traces(list(fig.data))
        changed, gone = _changes(fw.layout.to_plotly_json(), new_layout)
        for k in gone:
            fw.layout[k] = None
        if changed:
            fw.layout.update(changed, overwrite=True)
    _send_state(fw)


def _send_state(fw: go.FigureWidget) -> None:
    """Send the whole figure as well as the changes.

    plotly's widget applies each change (addTraces, relayout, ...) to its model's copy of the
    figure from a handler that exists only once the browser has loaded the widget's code (a
    5 MB module, loaded after the model is created). Changes that arrive before are dropped,
    and a view rendered from that copy shows a blank or stale figure — what a dashboard whose
    first run ends while the page is still loading got. The full state (the traits the view
    renders from) makes a late start show the figure as it is now."""
    fw._widget_data = deepcopy(fw._data)
    fw._widget_layout = deepcopy(fw._layout_obj._props)


def resend(fw: go.FigureWidget) -> None:
    """Send the whole figure to the browser again: every trace replaced, every layout property
    relayouted. (Setting equal values through the public API sends nothing, so the layout goes
    through the widget's own relayout message.)"""
    traces = [t.to_plotly_json() for t in fw.data]
    with fw.batch_update():
        fw.data = ()
        fw.add_traces(traces)
    fw._send_relayout_msg(fw.layout.to_plotly_json())


def figure_widget(fig: go.Figure, **layout) -> go.FigureWidget:
    fw = go.FigureWidget(fig)
    if layout:
        fw.layout.update(layout)
        _send_state(fw)
    return fw


class UI:
    """Runs widget updates on the kernel's own thread.

    A FigureWidget is not thread-safe: the browser answers each change with an edit id that the
    kernel handles on its main thread, and a change sent meanwhile from another thread tangles
    them (figures come out blank). So background threads hand their updates here; they run on
    the kernel's IOLoop (`add_callback` is thread-safe), in order. Outside a kernel (scripts,
    tests) there is no browser to answer and updates run at once, in the caller's thread.
    `flush()` runs what is queued; call it from the kernel's thread while it blocks (wait()).
    """

    def __init__(self):
        try:
            from IPython import get_ipython

            kernel = getattr(get_ipython(), "kernel", None)
        except ImportError:
            kernel = None
        self.loop = getattr(kernel, "io_loop", None)
        self.thread = threading.current_thread()
        self._jobs: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.idle = threading.Condition(self._lock)
        self.pending = 0

    @property
    def here(self) -> bool:
        return self.loop is None or threading.current_thread() is self.thread

    def call(self, fn, *args, **kwargs) -> None:
        if self.here:
            fn(*args, **kwargs)
            return
        with self._lock:
            self._jobs.append((fn, args, kwargs))
            self.pending += 1
        self.loop.add_callback(self.flush)

    HEAL_AFTER = (1.5, 6.0, 20.0, 45.0, 90.0)
    """Seconds after a new view of a figure appears at which it is sent the whole figure again
    (the late ones for a browser on a loaded machine: seen blank after 60 s with two cores
    shared by three clusters and chromium; the heals cost a redraw of an unchanged figure)."""

    def watch(self, fw: go.FigureWidget) -> go.FigureWidget:
        """Heal new browser views of `fw`.

        A plotly view that receives changes while it is still drawing its first plot (newPlot
        is asynchronous, and slow on a busy machine) can end up blank: seen in chromium when
        the first run finished while the page was still rendering. plotly's widget tracks its
        views (`_view_count`); when one appears, the whole figure is sent again a few times
        over the next seconds, which a healthy view redraws unchanged."""
        if self.loop is None:
            return fw

        def appeared(change):
            if (change["new"] or 0) > (change["old"] or 0):
                for delay in self.HEAL_AFTER:
                    self.loop.call_later(delay, resend, fw)

        fw.observe(appeared, names="_view_count")
        return fw

    def flush(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                fn, args, kwargs = self._jobs.popleft()
            try:
                fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.pending -= 1
                    self.idle.notify_all()
