"""Figures as pure functions: a RunResult (or a theory Estimate) in, a plotly go.Figure out.

They hold no state and touch no cluster, so the notebook's FigureWidgets, the CLI's HTML
report and the tests all draw the same thing. Wire bytes are the ring model's (DESIGN.md
section 4): gloo runs reduce-scatter as an all-reduce underneath, and the figures show the
algorithm, not gloo's own traffic.

The mesh view (`mesh_figure`) is a pure function of a MeshLayout, so it draws any layout
without a cluster.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

CATEGORIES = ("params", "grads", "optimizer", "activations")
CATEGORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B", "activations": "#E45756"}
OP_COLORS = {"all_reduce": "#4C78A8", "all_gather": "#72B7B2", "reduce_scatter": "#F58518",
             "all_to_all": "#B279A2", "send": "#54A24B", "recv": "#9D9D9D", "broadcast": "#EECA3B",
             "reduce": "#FF9DA6", "barrier": "#BAB0AC"}
MICROBATCH_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2",
                     "#FF9DA6", "#9D755D", "#BAB0AC"]
KIND_PATTERNS = {"F": "", "B": "/", "W": "x"}
KIND_COLORS = {"sync": "#BAB0AC", "opt": "#9D755D", "send": "#54A24B", "recv": "#9D9D9D"}
"""Spans outside any microbatch: waiting for the gradient reduction, the optimizer step, ..."""
"""Forward solid, backward hatched, weight-gradient cross-hatched: F/B/W told apart in one colour."""
KIB = 1024


STYLE = dict(template="none", paper_bgcolor="white", plot_bgcolor="white", font=dict(family="sans-serif", size=12),
             xaxis=dict(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8", automargin=True),
             yaxis=dict(gridcolor="#EBF0F8", zerolinecolor="#EBF0F8", automargin=True),
             hoverlabel=dict(align="left"))
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
    fig.add_annotation(text=text, xref="paper", x=0, y=y, xanchor="left", yanchor="bottom", showarrow=False,
                       font=dict(color=color, size=11))


def _rank_label(rk) -> str:
    return f"r{rk.rank}"


def _memory_rows(source) -> list[tuple[int, dict]]:
    """(rank, bytes by category) from a RunResult (measured) or an Estimate (predicted)."""
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
    ranks = [f"r{r}" for r, _ in rows]
    fig = _figure()
    for cat in CATEGORIES:
        fig.add_bar(name=cat, x=ranks, y=[m.get(cat, 0) / KIB for _, m in rows],
                    marker_color=CATEGORY_COLORS[cat],
                    hovertemplate=f"{cat}: %{{y:,.1f}} KiB<extra>%{{x}}</extra>")
    extra = sorted({k for _, m in rows for k in m} - set(CATEGORIES) - {"peak"})
    for cat in extra:   # transient categories a strategy tracks (e.g. ZeRO-3's gathered params)
        fig.add_scatter(name=f"{cat} (peak)", x=ranks, y=[m.get(cat, 0) / KIB for _, m in rows],
                        mode="markers", marker_symbol="triangle-up", marker_size=10)
    fig.add_scatter(name="peak", x=ranks, y=[m.get("peak", 0) / KIB for _, m in rows],
                    mode="markers", marker=dict(symbol="line-ew-open", size=26, color="black"))
    if estimate is not None:
        totals = [sum(estimate.memory[r].get(c, 0) for c in CATEGORIES) / KIB if r < len(estimate.memory) else None
                  for r, _ in rows]
        fig.add_scatter(name="theory", x=ranks, y=totals, mode="markers",
                        marker=dict(symbol="diamond", size=11, color="white", line=dict(width=2, color="black")))
    if capacity_bytes:
        _level(fig, capacity_bytes / KIB, "device capacity")
    return _layout(fig, "Memory per rank (KiB)", barmode="stack", yaxis_title="KiB")


def comm_figure(result, estimate=None) -> go.Figure:
    """Wire bytes each rank sends in one step, by mesh dim and op (ring model). `result` may
    also be an Estimate (bars predicted)."""
    rows = result.comm_table()
    if hasattr(result, "ranks"):
        rank_ids = [rk.rank for rk in result.ranks]
    else:
        rank_ids = list(range(len(result.memory)))
    ranks = [f"r{r}" for r in rank_ids]
    keys = sorted({(row["dim"], row["op"]) for row in rows})
    fig = _figure()
    for dim, op in keys:
        by_rank = {row["rank"]: row for row in rows if row["dim"] == dim and row["op"] == op}
        fig.add_bar(name=f"{op} [{dim}]", x=ranks,
                    y=[by_rank.get(r, {}).get("wire_bytes", 0) / KIB for r in rank_ids],
                    marker_color=OP_COLORS.get(op),
                    customdata=[by_rank.get(r, {}).get("calls", 0) for r in rank_ids],
                    hovertemplate=f"{op} on {dim}: %{{y:,.1f}} KiB in %{{customdata}} calls<extra>%{{x}}</extra>")
    if estimate is not None:
        pred: dict[int, float] = {}
        for row in estimate.comm_table():
            pred[row["rank"]] = pred.get(row["rank"], 0.0) + row["wire_bytes"]
        fig.add_scatter(name="theory", x=ranks, y=[pred.get(r, 0.0) / KIB for r in rank_ids],
                        mode="markers", marker=dict(symbol="diamond", size=11, color="white",
                                                    line=dict(width=2, color="black")))
    if not keys:
        fig.add_annotation(text="no communication in this layout", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
    return _layout(fig, "Communication per rank, one step (KiB sent, ring model)", barmode="stack",
                   yaxis_title="KiB")


def traffic_matrix(result, step: int = -1) -> tuple[list[int], np.ndarray]:
    """Bytes each rank sends to each other rank in one step: (ranks, M) with M[i, j] the bytes
    ranks[i] sends to ranks[j]. Each row sums to that rank's wire bytes in `comm_table()`.

    Attribution under the ring model (DESIGN.md section 4), group members in the order the
    group lists them (ascending ranks, as NCCL and gloo build their rings):
      all_reduce, all_gather, reduce_scatter, broadcast, reduce: the ring algorithms pass every
          chunk to the next member, so a rank's wire bytes all go to its successor in the group;
      all_to_all (and gather/scatter, whose root is not recorded): the pairwise exchange sends
          an equal share to each of the n - 1 other members;
      send: to its peer; recv sends nothing (the sender's row holds those bytes).
    """
    wanted = step % result.steps
    ranks = [rk.rank for rk in result.ranks]
    index = {r: i for i, r in enumerate(ranks)}
    out = np.zeros((len(ranks), len(ranks)))
    for rk in result.ranks:
        src = index[rk.rank]
        for e in rk.comm:
            if e.step != wanted or not e.wire_bytes:
                continue
            others = [g for g in e.group if g != rk.rank and g in index]
            if e.op == "send" and e.peer in index:
                out[src, index[e.peer]] += e.wire_bytes
            elif e.op in ("all_to_all", "gather", "scatter") and others:
                for g in others:
                    out[src, index[g]] += e.wire_bytes / len(others)
            elif rk.rank in e.group and len(e.group) > 1:
                nxt = e.group[(e.group.index(rk.rank) + 1) % len(e.group)]
                if nxt in index:
                    out[src, index[nxt]] += e.wire_bytes
    return ranks, out


def traffic_figure(result, step: int = -1) -> go.Figure:
    """Rank x rank heatmap of the bytes one rank sends another in one step (see traffic_matrix)."""
    ranks, m = traffic_matrix(result, step)
    labels = [f"r{r}" for r in ranks]
    fig = _figure(go.Heatmap(
        z=m / KIB, x=labels, y=labels, colorscale="Blues", zmin=0, zmax=max(float(m.max()) / KIB, 1.0), colorbar=dict(title="KiB"),
        texttemplate="%{z:,.0f}" if len(ranks) <= 16 else None,
        hovertemplate="%{y} → %{x}: %{z:,.1f} KiB<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title="sender")
    fig.update_xaxes(title="receiver", side="bottom")
    return _layout(fig, "Traffic, one step (KiB rank → rank, ring model)")


def timeline_figure(result, step: int = -1) -> go.Figure:
    """Gantt chart of one step: a row per rank; F/B/W coloured by microbatch (B hatched, W
    cross-hatched), communication on a thin lane below each rank; the bubble in the title.

    One bar trace per legend entry (a microbatch, a kind, an op on a dim), so a run with many
    microbatches stays a handful of traces and redraws quickly."""
    wanted = step % result.steps
    t0 = min((e.start for r in result.ranks for e in r.timeline if e.step == wanted), default=0.0)
    traces: dict[str, dict] = {}

    def bar(name: str, color: str, y: str, start: float, end: float, text: str, hover: str, pattern: str = ""):
        t = traces.setdefault(name, {"color": color, "y": [], "x": [], "base": [], "text": [], "hover": [],
                                     "pattern": []})
        t["y"].append(y)
        t["x"].append(max((end - start) * 1e3, 1e-3))
        t["base"].append((start - t0) * 1e3)
        t["text"].append(text)
        t["hover"].append(hover)
        t["pattern"].append(pattern)

    for rk in result.ranks:
        y = f"rank {rk.rank}"
        for e in rk.timeline:
            if e.step != wanted or e.kind == "step":
                continue
            mb = e.microbatch if e.microbatch is not None else -1
            color = MICROBATCH_COLORS[mb % len(MICROBATCH_COLORS)] if mb >= 0 else KIND_COLORS.get(e.kind, "#BAB0AC")
            bar(f"mb {mb}" if mb >= 0 else e.kind, color, y, e.start, e.end, f"{e.kind}{'' if mb < 0 else mb}",
                f"{e.kind} mb={e.microbatch} chunk={e.chunk}<br>{(e.start - t0) * 1e3:.2f}–"
                f"{(e.end - t0) * 1e3:.2f} ms<br>{y}", KIND_PATTERNS.get(e.kind, ""))
        for c in rk.comm:
            if c.step != wanted or c.end is None:
                continue
            bar(f"{c.op} [{c.dim}]", OP_COLORS.get(c.op, "#BAB0AC"), f"{y} comm", c.start, c.end, "",
                f"{c.op} on {c.dim} {c.group}<br>{c.payload_bytes:,} B<br>{y}")
    fig = _figure()
    for name, t in traces.items():
        fig.add_bar(y=t["y"], x=t["x"], base=t["base"], orientation="h", name=name, text=t["text"],
                    textposition="inside", hovertext=t["hover"], hovertemplate="%{hovertext}<extra></extra>",
                    marker=dict(color=t["color"], pattern_shape=t["pattern"], line=dict(width=0.5, color="white")))
    bubble = result.bubble_fraction(step)["overall"]
    used = {y for t in traces.values() for y in t["y"]}
    lanes = [y for rk in result.ranks for y in (f"rank {rk.rank}", f"rank {rk.rank} comm") if y in used]
    fig.update_yaxes(autorange="reversed", type="category", categoryorder="array", categoryarray=lanes)
    return _layout(fig, f"Timeline, step {wanted + 1} (bubble {bubble:.0%})", barmode="overlay",
                   xaxis_title="ms", bargap=0.25)


def loss_figure(result, ref=None) -> go.Figure:
    """Loss per step of the run, and of the one-process reference when given."""
    steps = list(range(1, len(result.losses) + 1))
    fig = _figure()
    fig.add_scatter(x=steps, y=result.losses, name=f"{result.config.impl} layout", mode="lines+markers")
    if ref is not None:
        fig.add_scatter(x=steps, y=ref.losses, name="reference (1 process)", mode="lines+markers",
                        line=dict(dash="dot", color="black"), marker_symbol="x")
    fig.update_xaxes(dtick=1)
    return _layout(fig, "Loss per step", xaxis_title="step", yaxis_title="loss")


MESH_TEXT_MAX = 64
"""Up to this many ranks the mesh view writes each rank's coordinates in its cell."""
MESH_LINES_MAX = 1024
"""Up to this many ranks it also draws each group as a ring through its members."""


def _mesh_columns(layout) -> int:
    """Columns of the mesh grid: the product of the innermost dims, up to about sqrt(world), so a
    row holds whole groups of the inner dims (neighbouring ranks, one node's fast links)."""
    cols = 1
    for d in layout.inner_first:
        if cols * cols >= layout.world:
            break
        cols *= layout.size(d)
    return cols


def mesh_figure(layout, dim: str = "tp", hosts: list[str] | None = None,
                devices: list[str] | None = None) -> go.Figure:
    """The ranks of a MeshLayout as a grid (rank = row * columns + column: inner dims along a
    row), each cell coloured by its group along `dim` ('dp', or a combination such as 'dp-cp'),
    each group drawn as a ring through its members, host and device on hover. Groups whose
    ranks sit on more than one host are outlined in red: their collectives cross the slower
    inter-node network."""
    dims = layout.canonical(tuple(dim.split("-")))
    world = layout.world
    hosts = list(hosts or [])[:world]
    hosts += ["localhost"] * (world - len(hosts))
    devices = list(devices or [])[:world]
    devices += ["cpu"] * (world - len(devices))
    groups = layout.groups(*dims)
    gid = np.empty(world, dtype=int)
    for i, g in enumerate(groups):
        gid[g] = i
    spanning = {i for i, g in enumerate(groups) if len({hosts[r] for r in g}) > 1}
    cols = _mesh_columns(layout)
    rows = -(-world // cols)
    ranks = np.arange(world)
    xs, ys = ranks % cols, ranks // cols
    label = layout.label(*dims)
    shown = [d for d in layout.inner_first[::-1] if layout.size(d) > 1]
    outer_first = layout.inner_first[::-1]
    idx = np.unravel_index(ranks, layout.grid.shape)   # (world,) per axis, outermost first
    coords = [dict(zip(outer_first, map(int, c))) for c in zip(*idx)]
    fig = _figure()
    if world <= MESH_LINES_MAX and len(groups[0]) > 1:
        lx, ly = [], []
        for g in groups:
            ring = g + g[:1]
            lx += [int(xs[r]) for r in ring] + [None]
            ly += [int(ys[r]) for r in ring] + [None]
        fig.add_scatter(x=lx, y=ly, mode="lines", line=dict(color="#888", width=1), hoverinfo="skip",
                        name=f"{label} groups (rings)")
    n = len(groups)
    if n <= len(MICROBATCH_COLORS):   # a discrete scale: group i gets palette colour i
        scale = [[(k + e) / n, MICROBATCH_COLORS[k]] for k in range(n) for e in (0, 1)]
        cmin, cmax = -0.5, n - 0.5
    else:
        scale, cmin, cmax = "Turbo", 0, max(n - 1, 1)
    text = np.array([f"r{r}<br>" + " ".join(f"{d}{coords[r][d]}" for d in shown) for r in range(world)]) \
        if world <= MESH_TEXT_MAX else None
    hover = np.array([f"rank {r}<br>{', '.join(f'{d}={coords[r][d]}' for d in outer_first)}"
                      f"<br>host {hosts[r]}, {devices[r]}<br>{label} group {gid[r]}: {groups[gid[r]][:16]}"
                      f"{' …' if len(groups[gid[r]]) > 16 else ''}"
                      f"{'<br><b>this group spans hosts</b>' if gid[r] in spanning else ''}" for r in range(world)])
    size = max(4, min(64, 420 // max(cols, rows)))
    crossing = np.isin(gid, list(spanning))
    # numeric colours on a shared scale, and one trace per outline: plotly validates a list of
    # colour strings element by element, which a 16k-rank mesh cannot afford
    for part, name, outline in ((~crossing, "ranks", dict(color="white", width=1)),
                                (crossing, f"{label} group spans hosts", dict(color="#D62728", width=3))):
        if not part.any():
            continue
        fig.add_scatter(
            x=xs[part], y=ys[part], mode="markers+text" if text is not None else "markers",
            text=None if text is None else text[part], textfont=dict(size=10, color="white"), hovertext=hover[part],
            hovertemplate="%{hovertext}<extra></extra>", name=name, showlegend=name != "ranks",
            customdata=ranks[part],
            marker=dict(symbol="square", size=size, color=gid[part], colorscale=scale, cmin=cmin, cmax=cmax,
                        line=outline))
    inner = [d for d in layout.inner_first if layout.size(d) > 1]
    fig.update_xaxes(visible=False, range=[-0.6, cols - 0.4])
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x", scaleratio=1)
    title = (f"Mesh {layout.describe()} ({layout.order}): {len(groups)} {label} group(s) of {len(groups[0])}"
             + (f", {len(spanning)} span hosts" if spanning else ""))
    fig.add_annotation(text=f"rank = row·{cols} + column; inner dims first: {'-'.join(inner) or '-'}",
                       showarrow=False, x=0, y=-0.08, xref="paper", yref="paper", xanchor="left",
                       font=dict(size=10, color="#666"))
    return _layout(fig, title)


def report_figures(result, ref=None, estimate=None) -> dict[str, go.Figure]:
    """Every figure of a run, by name (the CLI's HTML report and the dashboard use this)."""
    return {"memory": memory_figure(result, estimate), "comm": comm_figure(result, estimate),
            "timeline": timeline_figure(result), "loss": loss_figure(result, ref)}


__all__ = ["memory_figure", "comm_figure", "traffic_matrix", "traffic_figure", "timeline_figure", "loss_figure",
           "mesh_figure", "empty_figure", "report_figures"]
