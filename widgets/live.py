"""Showing a new go.Figure in an existing go.FigureWidget, in place and as one batch.

The widgets never rebuild their FigureWidgets: a notebook output keeps pointing at the same
object, and the browser receives one batch of changes (`batch_update`) per figure. Only the
properties that changed are set: plotly validates every property it is given, and on a
redraw most of a figure (its style, axes, colours) is what it was.
"""
from __future__ import annotations

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
    return ({k: v for k, v in new.items() if k not in old or not same(old[k], v)},
            [k for k in old if k not in new])


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


def figure_widget(fig: go.Figure, **layout) -> go.FigureWidget:
    fw = go.FigureWidget(fig)
    if layout:
        fw.layout.update(layout)
    return fw
