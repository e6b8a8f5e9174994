"""Figures as pure functions: a RunResult (or a theory Estimate) in, a plotly go.Figure out.

They hold no state and touch no cluster, so the notebook's FigureWidgets, the CLI's HTML
report and the tests all draw the same thing. Wire bytes are the ring model's (DERIVATIONS.md):
gloo runs reduce-scatter as an all-reduce underneath, and the figures show the algorithm, not
gloo's own traffic.

The mesh view (`mesh_figure`) is a pure function of a MeshLayout, so it draws any layout
without a cluster. The newer lessons' figures are re-exported from their own files: a verify report
(verify_figure.py), expert load (experts_figure.py), the planner's links, alternatives and node
crossings (planner_figures.py), the cp kinds (context_figure.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go

from labkit.widgets.context_figure import context_kinds_figure, context_scale_figure  # noqa: F401  (re-exported)
from labkit.widgets.experts_figure import expert_load_figure, token_crossing_figure  # noqa: F401
from labkit.widgets.locate_figure import locate_figure  # noqa: F401  (re-exported)
from labkit.widgets.mesh_figure import mesh_figure  # noqa: F401  (re-exported)
from labkit.widgets.planner_figures import (  # noqa: F401  (re-exported)
    alternatives_figure,
    group_crossings_figure,
    links_figure,
)
from labkit.widgets.style import (
    CATEGORIES,
    CATEGORY_COLORS,
    KIB,
    OP_COLORS,
    Palette,
    _figure,
    _layout,
    _level,
)
from labkit.widgets.timeline import (
    simulated_timeline_figure,
    timeline_comparison_figure,
    timeline_figure,
)
from labkit.widgets.verify_figure import verifies_figure, verify_figure  # noqa: F401  (re-exported)


def _rank_label(rk) -> str:
    return f"r{rk.rank}"


def _memory_rows(source) -> list[tuple[int, dict]]:
    """(rank, bytes by category) from a RunResult (measured) or an Estimate (predicted)."""
    # measured: one report per rank, each with its rank id; predicted: a list indexed by rank
    if hasattr(source, "ranks"):
        return [(rk.rank, rk.memory) for rk in source.ranks]
    return list(enumerate(source.memory))


def empty_figure(title: str, text: str = "waiting for the first run") -> go.Figure:
    """A titled figure with a note in the middle (before the first run, or nothing to show)."""
    fig = _figure()
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title)


def memory_figure(result, estimate=None, capacity_bytes: float | None = None) -> go.Figure:
    """Memory per rank, stacked by category (KiB); theory's total per rank as markers, and a
    line at the device's capacity when known. `result` may also be an Estimate (bars predicted)."""
    rows = _memory_rows(result)
    # 'r0', 'r1', ... and not numbers: plotly puts numbers on a linear axis, with ticks between ranks
    ranks = [f"r{r}" for r, _ in rows]
    fig = _figure()
    # every category gets its series, zero or not, in one order (the ZeRO paper's states, then the
    # activations on top): the legend and the colours stay put from one run to the next
    for cat in CATEGORIES:
        fig.add_bar(
            name=cat,
            x=ranks,
            # KiB: the lab's models hold kilobytes to a few megabytes a rank; bytes would print 7-digit ticks
            y=[m.get(cat, 0) / KIB for _, m in rows],
            marker_color=CATEGORY_COLORS[cat],
            hovertemplate=f"{cat}: %{{y:,.1f}} KiB<extra>%{{x}}</extra>",
        )
    # 'peak' is no category but the largest total at one moment: drawn apart below
    extra = sorted({k for _, m in rows for k in m} - set(CATEGORIES) - {"peak"})
    colors = Palette()
    # markers, not stacked bars: a transient category's value is its own peak, reached at another moment
    # than the steady states', and stacking it would claim that they coincide
    for cat in extra:  # transient categories a strategy tracks (e.g. ZeRO-3's gathered params)
        fig.add_scatter(
            name=f"{cat} (peak)",
            x=ranks,
            y=[m.get(cat, 0) / KIB for _, m in rows],
            mode="markers",
            marker=dict(symbol="triangle-up", size=10, color=colors(cat, "#B279A2")),
        )
    # a tick at the largest total at one moment (on CUDA the allocator's max_memory_allocated): the
    # transient categories each peak at a moment of their own, so the tick need not meet the stack's top
    fig.add_scatter(
        name="peak",
        x=ranks,
        y=[m.get("peak", 0) / KIB for _, m in rows],
        mode="markers",
        marker=dict(symbol="line-ew-open", size=26, color="black"),
    )
    if estimate is not None:
        # the theory's total of the same categories, against the stack (not the tick); None past the
        # estimate's ranks leaves a gap instead of a false 0
        totals = [
            sum(estimate.memory[r].get(c, 0) for c in CATEGORIES) / KIB if r < len(estimate.memory) else None
            for r, _ in rows
        ]
        fig.add_scatter(
            name="theory",
            x=ranks,
            y=totals,
            mode="markers",
            marker=dict(symbol="diamond", size=11, color="white", line=dict(width=2, color="black")),
        )
    if capacity_bytes:
        _level(fig, capacity_bytes / KIB, "device capacity")
    return _layout(fig, "Memory per rank (KiB)", barmode="stack", yaxis_title="KiB")


def comm_figure(result, estimate=None) -> go.Figure:
    """Wire bytes each rank sends in one step, by mesh dim and op (ring model). `result` may
    also be an Estimate (bars predicted)."""
    rows = result.comm_table()
    # measured: the reports' rank ids; an Estimate has one memory row per rank, which gives its ranks
    if hasattr(result, "ranks"):
        rank_ids = [rk.rank for rk in result.ranks]
    else:
        rank_ids = list(range(len(result.memory)))
    ranks = [f"r{r}" for r in rank_ids]
    # one series per (dim, op), sorted: a dim's ops sit together in the legend and stack in the same
    # order on every run
    keys = sorted({(row["dim"], row["op"]) for row in rows})
    fig = _figure()
    colors = Palette()  # all_reduce on dp and on tp: two shades of the op's colour
    for dim, op in keys:
        by_rank = {row["rank"]: row for row in rows if row["dim"] == dim and row["op"] == op}
        fig.add_bar(
            name=f"{op} [{dim}]",
            x=ranks,
            # 0 where a rank has no such op: each series has a bar per rank, so the stacks stay aligned
            y=[by_rank.get(r, {}).get("wire_bytes", 0) / KIB for r in rank_ids],
            marker_color=colors(f"{op} [{dim}]", OP_COLORS.get(op, "#4D4D4D")),
            # the calls ride along as customdata so the hover can say how many ops made the bytes
            customdata=[by_rank.get(r, {}).get("calls", 0) for r in rank_ids],
            hovertemplate=f"{op} on {dim}: %{{y:,.1f}} KiB in %{{customdata}} calls<extra>%{{x}}</extra>",
        )
    if estimate is not None:
        pred: dict[int, float] = {}
        # the theory's total per rank over every dim and op: one diamond against the top of each stack
        for row in estimate.comm_table():
            pred[row["rank"]] = pred.get(row["rank"], 0.0) + row["wire_bytes"]
        fig.add_scatter(
            name="theory",
            x=ranks,
            y=[pred.get(r, 0.0) / KIB for r in rank_ids],
            mode="markers",
            marker=dict(symbol="diamond", size=11, color="white", line=dict(width=2, color="black")),
        )
    # a layout with no collectives (one rank) would otherwise draw bare axes, which reads as a failure
    if not keys:
        fig.add_annotation(
            text="no communication in this layout", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper"
        )
    return _layout(fig, "Communication per rank, one step (KiB, ring model)", barmode="stack", yaxis_title="KiB sent")


def traffic_matrix(result, step: int = -1) -> tuple[list[int], np.ndarray]:
    """Bytes each rank sends to each other rank in one step: (ranks, M) with M[i, j] the bytes
    ranks[i] sends to ranks[j]. Each row sums to that rank's wire bytes in `comm_table()`.

    Attribution under the ring model (DERIVATIONS.md), group members in the order the
    group lists them (ascending ranks, as NCCL and gloo build their rings):
      all_reduce, all_gather, reduce_scatter, broadcast, reduce: the ring algorithms pass every
          chunk to the next member, so a rank's wire bytes all go to its successor in the group;
      all_to_all (and gather/scatter, whose root is not recorded): the pairwise exchange sends
          an equal share to each of the n - 1 other members;
      send: to its peer; recv sends nothing (the sender's row holds those bytes).
    """
    # a negative step counts from the end (-1: the last), as Python's indexing does
    wanted = step % result.steps
    ranks = [rk.rank for rk in result.ranks]
    index = {r: i for i, r in enumerate(ranks)}
    out = np.zeros((len(ranks), len(ranks)))
    for rk in result.ranks:
        src = index[rk.rank]
        for e in rk.comm:
            # a recv has no wire bytes: the sender's row carries the message
            if e.step != wanted or not e.wire_bytes:
                continue
            # a member with no report in this result has no column to receive in
            others = [g for g in e.group if g != rk.rank and g in index]
            if e.op == "send" and e.peer in index:
                out[src, index[e.peer]] += e.wire_bytes
            # gather's and scatter's root is not recorded: spread evenly, as an all-to-all sends
            elif e.op in ("all_to_all", "gather", "scatter") and others:
                for g in others:
                    out[src, index[g]] += e.wire_bytes / len(others)
            # a ring collective: every byte to the next member in the group's own order, wrapping round
            # (ascending ranks, as NCCL and gloo build their rings: DERIVATIONS.md, "The ring model")
            elif rk.rank in e.group and len(e.group) > 1:
                nxt = e.group[(e.group.index(rk.rank) + 1) % len(e.group)]
                if nxt in index:
                    out[src, index[nxt]] += e.wire_bytes
    return ranks, out


def traffic_figure(result, step: int = -1) -> go.Figure:
    """Rank x rank heatmap of the bytes one rank sends another in one step (see traffic_matrix)."""
    ranks, m = traffic_matrix(result, step)
    labels = [f"r{r}" for r in ranks]
    fig = _figure(
        go.Heatmap(
            z=m / KIB,
            x=labels,
            y=labels,
            # one hue from white: amounts have no sign, and a white cell reads as no traffic
            colorscale="Blues",
            zmin=0,
            # at least 1 KiB, so an all-zero matrix does not give plotly an empty 0..0 scale
            zmax=max(float(m.max()) / KIB, 1.0),
            colorbar=dict(title="KiB"),
            # numbers in the cells only while they stay legible (16 ranks: 256 cells)
            texttemplate="%{z:,.0f}" if len(ranks) <= 16 else None,
            hovertemplate="%{y} → %{x}: %{z:,.1f} KiB<extra></extra>",
        )
    )
    # senders top to bottom in rank order, as a matrix is read (plotly's y axis runs upwards)
    fig.update_yaxes(autorange="reversed", title="sender")
    fig.update_xaxes(title="receiver", side="bottom")
    return _layout(fig, "Traffic, one step (KiB rank → rank, ring model)")


def loss_figure(result, ref=None) -> go.Figure:
    """Loss per step of the run, and of the one-process reference when given."""
    steps = list(range(1, len(result.losses) + 1))
    fig = _figure()
    fig.add_scatter(
        x=steps,
        y=result.losses,
        # 'lab' or 'torch': whose implementation of the layout trained
        name=f"{result.config.impl} layout",
        mode="lines+markers",
        line=dict(color=CATEGORY_COLORS["params"]),
    )
    if ref is not None:
        # the reference dotted on top, with its own markers: where the two agree, as the oracle holds them
        # to, both stay visible
        fig.add_scatter(
            x=steps,
            y=ref.losses,
            name="reference (1 process)",
            mode="lines+markers",
            line=dict(dash="dot", color="black"),
            marker_symbol="x",
        )
    # a tick per step: a run is a handful of steps, and plotly would label fractional ones
    fig.update_xaxes(dtick=1)
    return _layout(fig, "Loss per step", xaxis_title="step", yaxis_title="loss")


@dataclass(frozen=True)
class RunFigure:
    """One figure of a run or a measurement: the one list (RUN_FIGURES) the CLI's HTML report, the
    Dashboard's panels and the palette test all read."""

    name: str
    title: str
    draw: Callable
    """(result, ref, estimate, capacity_bytes) -> the figure, or None where it says nothing of that result."""
    on_dashboard: bool = True
    """A panel of the Dashboard (widgets/dashboard.py lays them out), or the report's alone."""


def _config(result):
    return getattr(result, "config", None)  # None: a Measurement (lab.measure, lab.torchrun): no layout, no loss


RUN_FIGURES = (
    RunFigure("memory", "Memory per rank", lambda res, ref, est, cap: memory_figure(res, est, cap)),
    RunFigure("comm", "Communication per rank", lambda res, ref, est, cap: comm_figure(res, est)),
    RunFigure("timeline", "Timeline", lambda res, *_: timeline_figure(res)),
    RunFigure("traffic", "Traffic rank → rank", lambda res, *_: traffic_figure(res)),
    RunFigure("loss", "Loss per step", lambda res, ref, *_: loss_figure(res, ref) if _config(res) else None),
    # the measured schedule beside the simulated one only where there is a pipeline to compare; the
    # Dashboard's timeline panel shows the measured one
    RunFigure(
        "pipeline",
        "Pipeline: measured and simulated",
        lambda res, *_: timeline_comparison_figure(res) if _config(res) and _config(res).pp > 1 else None,
        on_dashboard=False,
    ),
)


def report_figures(result, ref=None, estimate=None, capacity_bytes=None) -> dict[str, go.Figure]:
    """Every figure of RUN_FIGURES that says something of `result` (a RunResult or a Measurement), by name."""
    figs = {f.name: f.draw(result, ref, estimate, capacity_bytes) for f in RUN_FIGURES}
    return {name: fig for name, fig in figs.items() if fig is not None}


__all__ = [
    "memory_figure",
    "comm_figure",
    "traffic_matrix",
    "traffic_figure",
    "timeline_figure",
    "loss_figure",
    "mesh_figure",
    "empty_figure",
    "report_figures",
    "RUN_FIGURES",
    "RunFigure",
    "simulated_timeline_figure",
    "timeline_comparison_figure",
    "verify_figure",
    "verifies_figure",
    "locate_figure",
    "expert_load_figure",
    "token_crossing_figure",
    "links_figure",
    "alternatives_figure",
    "group_crossings_figure",
    "context_scale_figure",
    "context_kinds_figure",
]
