"""Where a run left the one-process reference, drawn (labkit/oracle/locate.py): every record's worst piece
as its error over its bound, on a log scale (the bound is 1), modules down in the order forward ran them,
forward then backward across; the first record beyond its bound marked. Pure: `locate.ratios(result, own)`
(plain rows) in, a go.Figure out.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from labkit.widgets.style import _layout

FLOOR, CEIL = 1e-4, 1e4
"""The colour axis: an exact record (0) is drawn at the floor, one unmasked or in no piece (inf) or NaN at
the ceiling, where no finite ratio would say more."""
DIRECTIONS = ("forward", "backward")
SCALE = [[0.0, "#2CA02C"], [0.5, "#F7F7F7"], [1.0, "#D62728"]]
"""Green under the bound, white at it, red over: the bound (1) sits in the middle of the log axis."""


def _drawn(ratio: float) -> float:
    if math.isnan(ratio) or ratio >= CEIL:
        return math.log10(CEIL)
    return math.log10(max(ratio, FLOOR))


def locate_figure(rows: list[dict], title: str = "where the run left the one-process reference") -> go.Figure:
    """A heatmap of `rows` ({module, direction, ratio, failed}, locate.ratios), the first failed one marked."""
    modules = list(dict.fromkeys(r["module"] for r in rows))  # forward's order: every module runs forward first
    cell = {(r["module"], r["direction"]): r["ratio"] for r in rows}
    z = [[_drawn(cell[m, d]) if (m, d) in cell else None for d in DIRECTIONS] for m in modules]
    ticks = list(range(round(math.log10(FLOOR)), round(math.log10(CEIL)) + 1, 2))
    labels = [
        "0" if t == ticks[0] else "≥1e4 / ∞" if t == ticks[-1] else "1 (bound)" if t == 0 else f"1e{t}" for t in ticks
    ]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(DIRECTIONS),
            y=modules,
            zmin=math.log10(FLOOR),
            zmax=math.log10(CEIL),
            colorscale=SCALE,
            colorbar=dict(title="error / bound", tickvals=ticks, ticktext=labels),
            hovertemplate="%{y} %{x}: 10^%{z:.2f} of its bound<extra></extra>",
        )
    )
    first = next((r for r in rows if r["failed"]), None)
    if first is not None:
        fig.add_annotation(x=first["direction"], y=first["module"], text="first", showarrow=True, arrowhead=2)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, height=max(300, 14 * len(modules) + 120))
