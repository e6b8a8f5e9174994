"""labkit's figure style, shared by the pure figure builders (figures.py, timeline.py,
mesh_figure.py, theory_figures.py): colours per category, op and microbatch, and a plotly
layout that skips the default template."""

from __future__ import annotations

import plotly.graph_objects as go

CATEGORIES = ("params", "grads", "optimizer", "activations")
CATEGORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
OP_COLORS = {
    "all_reduce": "#4C78A8",
    "all_gather": "#72B7B2",
    "reduce_scatter": "#F58518",
    "all_to_all": "#B279A2",
    "send": "#54A24B",
    "recv": "#9D9D9D",
    "broadcast": "#EECA3B",
    "reduce": "#FF9DA6",
    "barrier": "#BAB0AC",
}
MICROBATCH_COLORS = [
    "#4C78A8",
    "#F58518",
    "#54A24B",
    "#E45756",
    "#72B7B2",
    "#EECA3B",
    "#B279A2",
    "#FF9DA6",
    "#9D755D",
    "#BAB0AC",
]
KIND_PATTERNS = {"F": "", "B": "/", "W": "x"}
"""Forward solid, backward hatched, weight-gradient cross-hatched: F/B/W told apart in one colour."""
KIND_COLORS = {"sync": "#BAB0AC", "opt": "#9D755D", "send": "#54A24B", "recv": "#9D9D9D"}
"""Spans outside any microbatch: waiting for the gradient reduction, the optimizer step, ..."""
KIB = 1024


STYLE = dict(
    template="none",
    paper_bgcolor="white",
    plot_bgcolor="white",
    font=dict(family="sans-serif", size=12),
    xaxis=dict(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8", automargin=True),
    yaxis=dict(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8", automargin=True),
    hoverlabel=dict(align="left"),
)
"""plotly_white's look without its template: a template is copied and validated into every
figure, which costs more than drawing the figure (the dashboard redraws six per change)."""


BASE = dict(STYLE, margin=dict(l=60, r=20, t=60, b=50), legend=dict(orientation="h", y=-0.25))


def _figure(data=None) -> go.Figure:
    """A new figure in labkit's style. Passing the style to the constructor skips plotly's
    default template (copied and validated on every go.Figure(): most of a small figure's cost)."""
    return go.Figure(data=data, layout=BASE)


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    """Title and the figure's own layout settings (and labkit's style, for a figure made elsewhere)."""
    if fig.layout.paper_bgcolor != "white":
        fig.update_layout(BASE)
    fig.update_layout(title=title, **kw)
    return fig


def _level(fig: go.Figure, y: float, text: str, color: str = "black") -> None:
    """A dashed horizontal line across the plot with a label: add_hline's look, a fraction of its cost."""
    fig.add_shape(type="line", xref="paper", x0=0, x1=1, y0=y, y1=y, line=dict(dash="dash", color=color))
    fig.add_annotation(
        text=text,
        xref="paper",
        x=0,
        y=y,
        xanchor="left",
        yanchor="bottom",
        showarrow=False,
        font=dict(color=color, size=11),
    )
