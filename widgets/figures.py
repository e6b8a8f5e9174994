"""Figures as pure functions: a RunResult (or a theory Estimate) in, a plotly go.Figure out.

They hold no state and touch no cluster, so the notebook's FigureWidgets, the CLI's HTML
report and the tests all draw the same thing. Wire bytes are the ring model's (DESIGN.md
section 4): gloo runs reduce-scatter as an all-reduce underneath, and the figures show the
algorithm, not gloo's own traffic.
"""
from __future__ import annotations

import plotly.graph_objects as go

CATEGORIES = ("params", "grads", "optimizer", "activations")
CATEGORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
OP_COLORS = {"all_reduce": "#4C78A8", "all_gather": "#72B7B2", "reduce_scatter": "#F58518",
             "all_to_all": "#B279A2", "send": "#54A24B", "recv": "#9D9D9D", "broadcast": "#EECA3B",
             "reduce": "#FF9DA6", "barrier": "#BAB0AC"}
MICROBATCH_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
                     "#FF9DA6", "#9D755D", "#BAB0AC"]
KIB = 1024
PATTERNS = {"B": "/", "W": "x"}
"""Backward hatched, weight-gradient cross-hatched; forward plain."""


def _layout(fig: go.Figure, title: str, **kw) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", margin=dict(l=60, r=20, t=60, b=50),
                      legend=dict(orientation="h", y=-0.2), **kw)
    return fig


def _rank_label(rk) -> str:
    return f"r{rk.rank}"


def memory_figure(result, estimate=None, capacity_bytes: float | None = None) -> go.Figure:
    """Memory per rank, stacked by category (KiB); theory's total per rank as markers, and a
    line at the device's capacity when known."""
    ranks = [_rank_label(r) for r in result.ranks]
    fig = go.Figure()
    for cat in CATEGORIES:
        fig.add_bar(name=cat, x=ranks, y=[r.memory.get(cat, 0) / KIB for r in result.ranks],
                    marker_color=CATEGORY_COLORS[cat],
                    hovertemplate=f"{cat}: %{{y:,.1f}} KiB<extra>%{{x}}</extra>")
    extra = sorted({k for r in result.ranks for k in r.memory} - set(CATEGORIES) - {"peak"})
    for cat in extra:   # transient categories a strategy tracks (e.g. ZeRO-3's gathered params)
        fig.add_scatter(name=f"{cat} (peak)", x=ranks, y=[r.memory.get(cat, 0) / KIB for r in result.ranks],
                        mode="markers", marker_symbol="triangle-up", marker_size=10)
    fig.add_scatter(name="peak", x=ranks, y=[r.memory.get("peak", 0) / KIB for r in result.ranks],
                    mode="markers", marker=dict(symbol="line-ew-open", size=26, color="black"))
    if estimate is not None:
        totals = [sum(estimate.memory[r.rank].get(c, 0) for c in CATEGORIES) / KIB for r in result.ranks]
        fig.add_scatter(name="theory", x=ranks, y=totals, mode="markers",
                        marker=dict(symbol="diamond", size=11, color="white", line=dict(width=2, color="black")))
    if capacity_bytes:
        fig.add_hline(y=capacity_bytes / KIB, line_dash="dash", annotation_text="device capacity")
    return _layout(fig, "Memory per rank (KiB)", barmode="stack", yaxis_title="KiB")


def comm_figure(result, estimate=None) -> go.Figure:
    """Wire bytes each rank sends in one step, by mesh dim and op (ring model)."""
    rows = result.comm_table()
    ranks = [_rank_label(r) for r in result.ranks]
    keys = sorted({(row["dim"], row["op"]) for row in rows})
    fig = go.Figure()
    for dim, op in keys:
        by_rank = {row["rank"]: row for row in rows if row["dim"] == dim and row["op"] == op}
        fig.add_bar(name=f"{op} [{dim}]", x=ranks,
                    y=[by_rank.get(r.rank, {}).get("wire_bytes", 0) / KIB for r in result.ranks],
                    marker_color=OP_COLORS.get(op),
                    customdata=[by_rank.get(r.rank, {}).get("calls", 0) for r in result.ranks],
                    hovertemplate=f"{op} on {dim}: %{{y:,.1f}} KiB in %{{customdata}} calls<extra>%{{x}}</extra>")
    if estimate is not None:
        pred: dict[int, float] = {}
        for row in estimate.comm_table():
            pred[row["rank"]] = pred.get(row["rank"], 0.0) + row["wire_bytes"]
        fig.add_scatter(name="theory", x=ranks, y=[pred.get(r.rank, 0.0) / KIB for r in result.ranks],
                        mode="markers", marker=dict(symbol="diamond", size=11, color="white",
                                                    line=dict(width=2, color="black")))
    if not keys:
        fig.add_annotation(text="no communication in this layout", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
    return _layout(fig, "Communication per rank, one step (KiB sent, ring model)", barmode="stack",
                   yaxis_title="KiB")


def timeline_figure(result, step: int = -1) -> go.Figure:
    """Gantt chart of one step: a row per rank; F/B/W coloured by microbatch (backward hatched),
    communication on a thin lane below each rank; the bubble in the title."""
    wanted = step % result.steps
    fig = go.Figure()
    ranks = result.ranks
    t0 = min((e.start for r in ranks for e in r.timeline if e.step == wanted), default=0.0)
    legend_seen = set()
    for rk in ranks:
        y = f"rank {rk.rank}"
        for e in rk.timeline:
            if e.step != wanted or e.kind == "step":
                continue
            mb = e.microbatch if e.microbatch is not None else -1
            color = MICROBATCH_COLORS[mb % len(MICROBATCH_COLORS)] if mb >= 0 else "#BAB0AC"
            name = f"mb {mb}" if mb >= 0 else e.kind
            fig.add_bar(y=[y], x=[(e.end - e.start) * 1e3], base=[(e.start - t0) * 1e3], orientation="h",
                        name=name, legendgroup=name, showlegend=name not in legend_seen,
                        marker=dict(color=color, pattern_shape=PATTERNS.get(e.kind, ""),
                                    line=dict(width=0.5, color="white")),
                        text=f"{e.kind}{'' if mb < 0 else mb}{f'.{e.chunk}' if e.chunk else ''}", textposition="inside",
                        hovertemplate=f"{e.kind} mb={e.microbatch} chunk={e.chunk}<br>%{{base:.2f}}–"
                                      f"{(e.end - t0) * 1e3:.2f} ms<extra>{y}</extra>")
            legend_seen.add(name)
        for c in rk.comm:
            if c.step != wanted or c.end is None:
                continue
            name = f"{c.op} [{c.dim}]"
            fig.add_bar(y=[f"{y} comm"], x=[max((c.end - c.start) * 1e3, 1e-3)], base=[(c.start - t0) * 1e3],
                        orientation="h", name=name, legendgroup=name, showlegend=name not in legend_seen,
                        marker_color=OP_COLORS.get(c.op, "#BAB0AC"),
                        hovertemplate=f"{c.op} on {c.dim} {c.group}<br>{c.payload_bytes:,} B<extra>{y}</extra>")
            legend_seen.add(name)
    bubble = result.bubble_fraction(step)["overall"]
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, f"Timeline, step {wanted + 1} (bubble {bubble:.0%})", barmode="overlay",
                   xaxis_title="ms", bargap=0.25)


def _gantt(fig: go.Figure, spans: list[dict], row: int | None = None, unit: str = "ms",
           seen: set | None = None) -> None:
    """Bars for spans {'y', 'kind', 'microbatch', 'chunk', 'start', 'end'} (times in `unit`):
    F/B/W coloured by microbatch and hatched by kind; send/recv grey on the rank's comm lane."""
    seen = set() if seen is None else seen
    where = {} if row is None else {"row": row, "col": 1}
    for e in spans:
        mb, kind = e["microbatch"], e["kind"]
        compute = kind in PATTERNS or kind == "F"
        name = f"mb {mb}" if compute else kind
        y = e["y"] if compute else f"{e['y']} comm"
        chunk = f".{e['chunk']}" if e.get("chunk") else ""
        color = MICROBATCH_COLORS[mb % len(MICROBATCH_COLORS)] if compute else OP_COLORS.get(kind, "#BAB0AC")
        fig.add_trace(go.Bar(
            y=[y], x=[max(e["end"] - e["start"], 1e-6)], base=[e["start"]], orientation="h", name=name,
            legendgroup=name, showlegend=name not in seen, text=f"{kind}{mb}{chunk}" if compute else "",
            textposition="inside", marker=dict(color=color, pattern_shape=PATTERNS.get(kind, ""),
                                               line=dict(width=0.5, color="white")),
            hovertemplate=f"{kind} mb={mb} chunk={e.get('chunk')}<br>%{{base:.3g}}–{e['end']:.3g} {unit}"
                          f"<extra>{e['y']}</extra>"), **where)
        seen.add(name)


def simulated_timeline_figure(sim, unit: str = "units", title: str | None = None) -> go.Figure:
    """The simulator's ideal timeline of a pipeline plan (labkit.theory.pipeline.simulated):
    one row per pipeline rank, F/B/W coloured by microbatch, messages in flight on a thin
    lane below; the predicted bubble in the title, or why the plan would deadlock.
    unit: 'units' for unit costs; 'ms' for a simulation with measured costs (in seconds)."""
    scale = 1e3 if unit == "ms" else 1.0
    spans = [{**e, "y": f"rank {e['rank']}", "start": e["start"] * scale, "end": e["end"] * scale}
             for e in sim.events]
    fig = go.Figure()
    _gantt(fig, spans, unit=unit)
    pl = sim.plan
    if sim.problems:
        fig.add_annotation(text="<br>".join(sim.problems[:6]), showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper", font=dict(color="#E45756"))
        head = f"{pl.schedule}: would deadlock"
    else:
        head = f"{pl.schedule}, simulated: p={pl.p}, m={pl.m}" + (f", v={pl.v}" if pl.v > 1 else "") + \
               f" (bubble {sim.bubble:.0%})"
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, title or head, barmode="overlay", xaxis_title=unit, bargap=0.25)


def timeline_comparison_figure(result, sim=None, step: int = -1) -> go.Figure:
    """Measured (top) and simulated (bottom) timelines of a pipeline run on one ms axis. By
    default the simulation replays the run's schedule with its own measured mean t_F, t_B
    and fastest receive per stage (labkit.theory.pipeline.costs_from_result), so what differs
    is what the ideal model leaves out: jitter, contention for cores, Python overhead."""
    from plotly.subplots import make_subplots

    from labkit.theory import pipeline as pipeline_theory

    wanted = step % result.steps
    if sim is None:
        sim = pipeline_theory.simulated(result.config, pipeline_theory.costs_from_result(result, step))
    spans = [e for rk in result.ranks for e in rk.timeline if e.step == wanted]
    t0 = min((e.start for e in spans if e.kind in ("F", "B", "W")), default=0.0)
    measured = [{"y": f"rank {rk.rank}", "kind": e.kind, "microbatch": e.microbatch, "chunk": e.chunk,
                 "start": (e.start - t0) * 1e3, "end": (e.end - t0) * 1e3}
                for rk in result.ranks for e in rk.timeline
                if e.step == wanted and e.kind in ("F", "B", "W", "send", "recv")]
    # the simulated pipeline rank r stands for every rank with pp coordinate r (dp replicas alike)
    first = {}
    for rk in result.ranks:
        first.setdefault(rk.coords["pp"], rk.rank)
    simulated = [{**e, "y": f"rank {first[e['rank']]} (sim)", "start": e["start"] * 1e3, "end": e["end"] * 1e3}
                 for e in sim.events]
    bubble = result.bubble_fraction(step)["overall"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=(f"measured (bubble {bubble:.0%})", f"simulated (bubble {sim.bubble:.0%})"))
    seen: set = set()
    _gantt(fig, measured, row=1, seen=seen)
    _gantt(fig, simulated, row=2, seen=seen)
    fig.update_yaxes(autorange="reversed", type="category")
    cfg = result.config
    return _layout(fig, f"Pipeline {cfg.schedule}, pp={cfg.pp}, m={cfg.microbatches}: measured vs simulated",
                   barmode="overlay", xaxis2_title="ms", bargap=0.25, height=220 + 90 * len(result.ranks))


def loss_figure(result, ref=None) -> go.Figure:
    """Loss per step of the run, and of the one-process reference when given."""
    steps = list(range(1, len(result.losses) + 1))
    fig = go.Figure()
    fig.add_scatter(x=steps, y=result.losses, name=f"{result.config.impl} layout", mode="lines+markers")
    if ref is not None:
        fig.add_scatter(x=steps, y=ref.losses, name="reference (1 process)", mode="lines+markers",
                        line=dict(dash="dot", color="black"), marker_symbol="x")
    return _layout(fig, "Loss per step", xaxis_title="step", yaxis_title="loss")


def report_figures(result, ref=None, estimate=None) -> dict[str, go.Figure]:
    """Every figure of a run, by name (the CLI's HTML report and the dashboard use this)."""
    figs = {"memory": memory_figure(result, estimate), "comm": comm_figure(result, estimate),
            "timeline": timeline_figure(result), "loss": loss_figure(result, ref)}
    if result.config.pp > 1:
        figs["pipeline"] = timeline_comparison_figure(result)
    return figs
