"""Timelines as pure functions of a RunResult or a simulation: the measured Gantt chart of one
step, the simulator's ideal one, and the two on one axis (re-exported by widgets/figures.py)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.theory.exact import pipeline as pipeline_theory
from labkit.widgets.style import (
    KIND_COLORS,
    KIND_PATTERNS,
    MICROBATCH_COLORS,
    OP_COLORS,
    REGION_COLOR,
    Palette,
    _figure,
    _layout,
)


def span_label(kind: str, microbatch=None, chunk=None) -> str:
    """'F mb=0', 'B mb=3 chunk=1', 'opt': what a span is, its unset fields left out."""
    parts = [kind] + [f"{k}={v}" for k, v in (("mb", microbatch), ("chunk", chunk)) if v is not None]
    return " ".join(parts)


def _preferred(name: str, kind: str, microbatch) -> str:
    """A series' own colour: its microbatch's, its op's (comm lanes), its kind's, or a region's."""
    if microbatch is not None and microbatch >= 0:
        return MICROBATCH_COLORS[microbatch % len(MICROBATCH_COLORS)]
    return OP_COLORS.get(name.split(" [")[0]) if " [" in name else KIND_COLORS.get(kind, REGION_COLOR)


def timeline_figure(result, step: int = -1) -> go.Figure:
    """Gantt chart of one step: a row per rank; F/B/W coloured by microbatch (B hatched, W
    cross-hatched), communication on a thin lane below each rank; the bubble in the title.

    One bar trace per legend entry (a microbatch, a kind, an op on a dim), so a run with many
    microbatches stays a handful of traces and redraws quickly."""
    # a negative step counts from the end (-1: the last), as Python's indexing does
    wanted = step % result.steps
    # every span from the step's first start on any rank: all rows share one origin
    t0 = min((e.start for r in result.ranks for e in r.timeline if e.step == wanted), default=0.0)
    traces: dict[str, dict] = {}

    def bar(name: str, color: str, y: str, start: float, end: float, text: str, hover: str, pattern: str = ""):
        t = traces.setdefault(
            name, {"preferred": color, "y": [], "x": [], "base": [], "text": [], "hover": [], "pattern": []}
        )
        t["y"].append(y)
        # ms; at least 1 µs, so a span the clock saw as instant still draws
        t["x"].append(max((end - start) * 1e3, 1e-3))
        t["base"].append((start - t0) * 1e3)
        t["text"].append(text)
        t["hover"].append(hover)
        t["pattern"].append(pattern)

    for rk in result.ranks:
        y = f"rank {rk.rank}"
        for e in rk.timeline:
            # the 'step' span covers all the others: drawn, it would hide them
            if e.step != wanted or e.kind == "step":
                continue
            # -1: a span of no microbatch (sync, opt, a user's region), named by its kind
            mb = e.microbatch if e.microbatch is not None else -1
            name = f"mb {mb}" if mb >= 0 else e.kind
            bar(
                name,
                _preferred(name, e.kind, mb),
                y,
                e.start,
                e.end,
                # 'F3.1': kind, microbatch and chunk, short enough to fit inside the bar
                f"{e.kind}{'' if mb < 0 else mb}{f'.{e.chunk}' if e.chunk else ''}",
                f"{span_label(e.kind, e.microbatch, e.chunk)}<br>{(e.start - t0) * 1e3:.2f}–"
                f"{(e.end - t0) * 1e3:.2f} ms<br>{y}",
                KIND_PATTERNS.get(e.kind, ""),
            )
        for c in rk.comm:
            # an op whose end was never seen has no bar to draw
            if c.step != wanted or c.end is None:
                continue
            bar(
                # comm on a thin lane of its own under the rank, one series per op and dim as in comm_figure
                f"{c.op} [{c.dim}]",
                OP_COLORS.get(c.op, "#4D4D4D"),
                f"{y} comm",
                c.start,
                c.end,
                "",
                f"{c.op} on {c.dim} {c.group}<br>{c.payload_bytes:,} B<br>{y}",
            )
    fig = _figure()
    colors = Palette()
    for name in sorted(traces, key=_series_order):  # colours by a fixed order, not by arrival
        colors(name, traces[name]["preferred"])
    # one bar trace per series, however many spans it holds: a run with many microbatches redraws fast
    for name, t in traces.items():
        fig.add_bar(
            y=t["y"],
            x=t["x"],
            base=t["base"],
            orientation="h",
            name=name,
            text=t["text"],
            textposition="inside",
            hovertext=t["hover"],
            hovertemplate="%{hovertext}<extra></extra>",
            # one colour per microbatch, and the pattern per bar: F solid, B hatched, W cross-hatched
            marker=dict(color=colors.of[name], pattern_shape=t["pattern"], line=dict(width=0.5, color="white")),
        )
    bubble = result.bubble_fraction(step)["overall"]
    # each rank's lane, then its comm lane right under it; lanes with nothing in them are left out
    used = {y for t in traces.values() for y in t["y"]}
    lanes = [y for rk in result.ranks for y in (f"rank {rk.rank}", f"rank {rk.rank} comm") if y in used]
    # an explicit category order: plotly would order the lanes by which trace first uses them
    fig.update_yaxes(autorange="reversed", type="category", categoryorder="array", categoryarray=lanes)
    # 'overlay': bars with a base sit at their own times, neither stacked nor side by side
    return _layout(
        fig, f"Timeline, step {wanted + 1} (bubble {bubble:.0%})", barmode="overlay", xaxis_title="ms", bargap=0.25
    )


def _series_order(name: str) -> tuple:
    """Microbatches in their order, then the spans' kinds, then the comm lanes (op [dim])."""
    if name.startswith("mb ") and name[3:].isdigit():
        return (0, int(name[3:]), "")
    return (2 if " [" in name else 1, 0, name)


def _gantt(
    fig: go.Figure, spans: list[dict], row: int | None = None, unit: str = "ms", seen: set | None = None
) -> None:
    """Bars for spans {'y', 'kind', 'microbatch', 'chunk', 'start', 'end'} (times in `unit`):
    F/B/W coloured by microbatch and hatched by kind; send/recv grey on the rank's comm lane."""
    seen = set() if seen is None else seen
    where = {} if row is None else {"row": row, "col": 1}
    colors = Palette()
    for e in spans:
        mb, kind = e["microbatch"], e["kind"]
        compute = kind in KIND_PATTERNS or kind == "F"
        name = f"mb {mb}" if compute else kind
        y = e["y"] if compute else f"{e['y']} comm"
        chunk = f".{e['chunk']}" if e.get("chunk") else ""
        own = MICROBATCH_COLORS[mb % len(MICROBATCH_COLORS)] if compute else KIND_COLORS.get(kind, "#4D4D4D")
        color = colors(name, own)
        fig.add_trace(
            go.Bar(
                y=[y],
                # a zero-length span still draws as a sliver
                x=[max(e["end"] - e["start"], 1e-6)],
                base=[e["start"]],
                orientation="h",
                name=name,
                # one legend entry per name over both panels (the caller shares `seen`); clicking it hides both
                legendgroup=name,
                showlegend=name not in seen,
                text=f"{kind}{mb}{chunk}" if compute else "",
                textposition="inside",
                marker=dict(
                    color=color, pattern_shape=KIND_PATTERNS.get(kind, ""), line=dict(width=0.5, color="white")
                ),
                hovertemplate=f"{span_label(kind, mb, e.get('chunk'))}<br>%{{base:.3g}}–{e['end']:.3g} {unit}"
                f"<extra>{e['y']}</extra>",
            ),
            **where,
        )
        seen.add(name)


def simulated_timeline_figure(sim, unit: str = "units", title: str | None = None) -> go.Figure:
    """The simulator's ideal timeline of a pipeline schedule (labkit.theory.exact.pipeline.simulated):
    one row per pipeline rank, F/B/W coloured by microbatch, messages in flight on a thin
    lane below; the predicted bubble in the title, or why the schedule would deadlock.
    unit: 'units' for unit costs; 'ms' for a simulation with measured costs (in seconds)."""
    # a simulation with measured costs runs in seconds: ms on the axis, as the measured timeline has
    scale = 1e3 if unit == "ms" else 1.0
    spans = [{**e, "y": f"rank {e['rank']}", "start": e["start"] * scale, "end": e["end"] * scale} for e in sim.events]
    fig = go.Figure()
    _gantt(fig, spans, unit=unit)
    table = sim.table
    if sim.problems:
        # a schedule that would deadlock has no timeline worth reading: the figure says why instead
        fig.add_annotation(
            text="<br>".join(sim.problems[:6]),
            showarrow=False,
            x=0.5,
            y=0.5,
            xref="paper",
            yref="paper",
            font=dict(color="#E45756"),
        )
        head = f"{table.schedule}: would deadlock"
    else:
        head = (
            f"{table.schedule}, simulated: p={table.p}, m={table.m}"
            + (f", v={table.v}" if table.v > 1 else "")
            + f" (bubble {sim.bubble:.0%})"
        )
    fig.update_yaxes(autorange="reversed", type="category")
    return _layout(fig, title or head, barmode="overlay", xaxis_title=unit, bargap=0.25)


def timeline_comparison_figure(result, sim=None, step: int = -1) -> go.Figure:
    """Measured (top) and simulated (bottom) timelines of a pipeline run on one ms axis. By
    default the simulation replays the run's schedule with its own measured mean t_F, t_B
    and fastest receive per stage (labkit.theory.exact.pipeline.costs_from_result), so what differs
    is what the ideal model leaves out: jitter, contention for cores, Python overhead."""

    wanted = step % result.steps
    # the run's own costs, so what still differs between the panels is what the ideal model leaves out
    if sim is None:
        sim = pipeline_theory.simulated(result.config, pipeline_theory.costs_from_result(result, step))
    spans = [e for rk in result.ranks for e in rk.timeline if e.step == wanted]
    # from the first compute span, as the simulation starts at its first F: the panels line up at 0
    t0 = min((e.start for e in spans if e.kind in ("F", "B", "W")), default=0.0)
    measured = [
        {
            "y": f"rank {rk.rank}",
            "kind": e.kind,
            "microbatch": e.microbatch,
            "chunk": e.chunk,
            "start": (e.start - t0) * 1e3,
            "end": (e.end - t0) * 1e3,
        }
        for rk in result.ranks
        for e in rk.timeline
        if e.step == wanted and e.kind in ("F", "B", "W", "send", "recv")
    ]
    # the simulated pipeline rank r stands for every rank with pp coordinate r (dp replicas alike)
    first = {}
    for rk in result.ranks:
        first.setdefault(rk.coords["pp"], rk.rank)
    simulated = [
        {**e, "y": f"rank {first[e['rank']]} (sim)", "start": e["start"] * 1e3, "end": e["end"] * 1e3}
        for e in sim.events
    ]
    bubble = result.bubble_fraction(step)["overall"]
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=(f"measured (bubble {bubble:.0%})", f"simulated (bubble {sim.bubble:.0%})"),
    )
    # one legend entry per microbatch for both panels
    seen: set = set()
    _gantt(fig, measured, row=1, seen=seen)
    _gantt(fig, simulated, row=2, seen=seen)
    fig.update_yaxes(autorange="reversed", type="category")
    cfg = result.config
    return _layout(
        fig,
        f"Pipeline {cfg.schedule}, pp={cfg.pp}, m={cfg.microbatches}: measured vs simulated",
        barmode="overlay",
        xaxis2_title="ms",
        bargap=0.25,
        # 90 px a rank over the two panels keeps each lane tall enough to read its label
        height=220 + 90 * len(result.ranks),
    )
