"""Figures of the theory at scale (pure: an AtScale prediction in, a go.Figure out), for the
ScaleExplorer. Bytes in GB (1e9), as GPU memory is sold."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.config.choices import zero_stages
from labkit.theory import pipeline_bubble
from labkit.widgets.style import (
    CATEGORIES,
    CATEGORY_COLORS,
    MICROBATCH_COLORS,
    OP_COLORS,
    Palette,
    _figure,
    _layout,
    _level,
)

GB = 1e9
STAGES = tuple(zero_stages().values())
"""The model-state figure's columns, ZeRO's stages in order (labkit/config/choices.py zero_stages)."""


def _capacity_line(fig: go.Figure, capacity: float | None) -> None:
    if capacity:
        # red, not the lab's black device line: at scale the capacity is what decides a layout
        _level(fig, capacity / GB, f"{capacity / GB:.0f} GB per GPU", "#D62728")


def stage_memory_figure(view, capacity: float | None = 80e9) -> go.Figure:
    """Predicted memory per GPU on one rank of each pipeline stage, stacked by category."""
    # 'stage k' labels: the shown stages skip some when pp > 16, and a category axis shows no gaps
    x = [f"stage {s}" for s in view.stages]
    fig = _figure()
    for cat in CATEGORIES:
        fig.add_bar(
            name=cat,
            x=x,
            # GB (1e9): the unit a GPU's memory is sold in, so the capacity line reads as the datasheet does
            y=[m.get(cat, 0) / GB for m in view.memory],
            marker_color=CATEGORY_COLORS[cat],
            hovertemplate=f"{cat}: %{{y:,.1f}} GB<extra>%{{x}}</extra>",
        )
    _capacity_line(fig, capacity)
    worst = view.peak / GB
    # the fullest shown stage decides: one GPU over its capacity fails the whole step
    verdict = "" if not capacity else (" — fits" if view.peak <= capacity else " — does not fit")
    return _layout(fig, f"Memory per GPU, predicted (max {worst:,.1f} GB{verdict})", barmode="stack", yaxis_title="GB")


def zero_figure(view, capacity: float | None = 80e9) -> go.Figure:
    """Model states per GPU for each ZeRO stage at this dp and precision (theory.model_state_bytes:
    Rajbhandari et al. 2020, figure 1), the layout's own stage marked."""
    fig = _figure()
    # model states only, as the paper's figure 1: activations do not change with the ZeRO stage
    for cat in ("params", "grads", "optimizer"):
        fig.add_bar(
            name=cat,
            x=list(STAGES),
            y=[view.states[s][cat] / GB for s in STAGES],
            marker_color=CATEGORY_COLORS[cat],
            hovertemplate=f"{cat}: %{{y:,.1f}} GB<extra>%{{x}}</extra>",
        )
    mine = zero_stages()[view.config.sharded.stage]  # FSDP shards like ZeRO-3
    # an arrow at the top of its column marks this layout's stage without a legend entry
    fig.add_annotation(x=mine, y=view.states[mine]["total"] / GB, text="this layout", showarrow=True, arrowhead=2)
    _capacity_line(fig, capacity)
    return _layout(
        fig,
        f"Model states per GPU by ZeRO stage (N_d = {view.config.dp}, {view.config.precision})",
        barmode="stack",
        yaxis_title="GB",
    )


def stage_comm_figure(view) -> go.Figure:
    """Predicted bytes one GPU sends per step, by mesh dim and op (ring model), per pipeline stage."""
    x = [f"stage {s}" for s in view.stages]
    # one series per (dim, op), sorted: a dim's ops sit together and stack in the same order every redraw
    keys = sorted({(r["dim"], r["op"]) for rows in view.comm for r in rows})
    fig = _figure()
    colors = Palette()
    for dim, op in keys:
        # a stage's rows of one (dim, op) summed into one bar: calls and buckets are not told apart here
        y = [sum(r["wire_bytes"] for r in rows if (r["dim"], r["op"]) == (dim, op)) / GB for rows in view.comm]
        fig.add_bar(
            name=f"{op} [{dim}]",
            x=x,
            y=y,
            marker_color=colors(f"{op} [{dim}]", OP_COLORS.get(op, "#4D4D4D")),
            hovertemplate=f"{op} on {dim}: %{{y:,.2f}} GB<extra>%{{x}}</extra>",
        )
    # a large layout's comm is computed on a thread (widgets/scale.py): the figure draws now and says so
    if view.comm_pending:
        note = "computing…"
    elif not keys:
        note = "no communication in this layout"
    else:
        note = ""
    if note:
        fig.add_annotation(text=note, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    return _layout(
        fig, "Communication per GPU per step, predicted (GB)", barmode="stack", yaxis_title="GB sent (ring model)"
    )


def bubble_figure(view, most: int = 64) -> go.Figure:
    """The pipeline bubble (p - 1) / (v·m + p - 1) against microbatches m, for this pp and
    virtual stages (and v = 1 for comparison), with the layout's own point marked."""
    cfg = view.config
    # up to 64 microbatches, or the layout's own m where it is more: its point always lies on the curves
    ms = list(range(1, max(most, cfg.microbatches) + 1))
    fig = _figure()
    curves = {1: MICROBATCH_COLORS[0], cfg.virtual_stages: MICROBATCH_COLORS[1]}  # one curve when v = 1
    # v = 1 first, so an interleaved curve is drawn over plain 1F1B's
    for v, color in sorted(curves.items()):
        fig.add_scatter(
            x=ms, y=[pipeline_bubble(cfg.pp, m, v) for m in ms], mode="lines", name=f"v = {v}", line=dict(color=color)
        )
    fig.add_scatter(
        x=[cfg.microbatches],
        y=[view.bubble],
        mode="markers",
        name="this layout",
        marker=dict(size=12, color="black", symbol="diamond"),
    )
    # log m: the bubble falls as 1/m, and a log axis spreads out the few m where the choice matters
    fig.update_xaxes(type="log", title="microbatches m")
    # 0 to 100% whatever the curves: the axis stays put while the controls move
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    return _layout(fig, f"Pipeline bubble, pp = {cfg.pp}: {view.bubble:.1%}")
