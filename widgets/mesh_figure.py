"""The mesh as a figure: a pure function of a MeshLayout (and where its ranks run), re-exported
by widgets/figures.py."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from labkit.widgets.style import MICROBATCH_COLORS, _figure, _layout

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


def mesh_figure(layout, dim: str = "tp", hosts: list[str] | None = None, devices: list[str] | None = None) -> go.Figure:
    """The ranks of a MeshLayout as a grid (rank = row * columns + column: inner dims along a
    row), each cell coloured by its group along `dim` ('dp', or a combination such as 'dp-cp'),
    each group drawn as a ring through its members, host and device on hover. Groups whose
    ranks sit on more than one host are outlined in red: their collectives cross the slower
    inter-node network."""
    dims = layout.canonical(tuple(dim.split("-")))
    world = layout.world
    # ranks the caller did not place run on one host, on the CPU: a layout drawn without a cluster
    hosts = list(hosts or [])[:world]
    hosts += ["localhost"] * (world - len(hosts))
    devices = list(devices or [])[:world]
    devices += ["cpu"] * (world - len(devices))
    groups = layout.groups(*dims)
    # gid[r]: the index of rank r's group along `dims`, the value its cell is coloured by
    gid = np.empty(world, dtype=int)
    for i, g in enumerate(groups):
        gid[g] = i
    spanning = {i for i, g in enumerate(groups) if len({hosts[r] for r in g}) > 1}
    cols = _mesh_columns(layout)
    # ceil(world / cols): the last row may be short
    rows = -(-world // cols)
    ranks = np.arange(world)
    xs, ys = ranks % cols, ranks // cols
    label = layout.label(*dims)
    # a cell writes only the dims of size > 1, outermost first: 'pp1 dp0 tp1', not every 0
    shown = [d for d in layout.inner_first[::-1] if layout.size(d) > 1]
    outer_first = layout.inner_first[::-1]
    idx = np.unravel_index(ranks, layout.grid.shape)  # (world,) per axis, outermost first
    coords = [dict(zip(outer_first, map(int, c))) for c in zip(*idx)]
    fig = _figure()
    # a 1-rank group has no ring to draw
    if world <= MESH_LINES_MAX and len(groups[0]) > 1:
        lx, ly = [], []
        for g in groups:
            # back to the first member to close the ring; None lifts the pen between groups, so all the
            # rings are one trace however many groups there are
            ring = g + g[:1]
            lx += [int(xs[r]) for r in ring] + [None]
            ly += [int(ys[r]) for r in ring] + [None]
        fig.add_scatter(
            x=lx, y=ly, mode="lines", line=dict(color="#888", width=1), hoverinfo="skip", name=f"{label} groups (rings)"
        )
    n = len(groups)
    if n <= len(MICROBATCH_COLORS):  # a discrete scale: group i gets palette colour i
        # colour k holds the band [k, k+1)/n of the scale, flat, and cmin/cmax put group k at its middle:
        # each group one palette colour, never a blend of two
        scale = [[(k + e) / n, MICROBATCH_COLORS[k]] for k in range(n) for e in (0, 1)]
        cmin, cmax = -0.5, n - 0.5
    else:
        # more groups than palette colours: Turbo, a rainbow whose neighbouring groups stay apart; the hover
        # names the group where two colours come close
        scale, cmin, cmax = "Turbo", 0, max(n - 1, 1)
    text = (
        np.array([f"r{r}<br>" + " ".join(f"{d}{coords[r][d]}" for d in shown) for r in range(world)])
        if world <= MESH_TEXT_MAX
        else None
    )
    hover = np.array(
        [
            f"rank {r}<br>{', '.join(f'{d}={coords[r][d]}' for d in outer_first)}"
            # at most 16 members listed: a dp group of a large mesh has thousands
            f"<br>host {hosts[r]}, {devices[r]}<br>{label} group {gid[r]}: {groups[gid[r]][:16]}"
            f"{' …' if len(groups[gid[r]]) > 16 else ''}"
            f"{'<br><b>this group spans hosts</b>' if gid[r] in spanning else ''}"
            for r in range(world)
        ]
    )
    # cells shrink with the grid to keep it about 420 px across, between 4 and 64 px each
    size = max(4, min(64, 420 // max(cols, rows)))
    crossing = np.isin(gid, list(spanning))
    # numeric colours on a shared scale, and one trace per outline: plotly validates a list of
    # colour strings element by element, which a 16k-rank mesh cannot afford
    for part, name, outline in (
        (~crossing, "ranks", dict(color="white", width=1)),
        (crossing, f"{label} group spans hosts", dict(color="#D62728", width=3)),
    ):
        if not part.any():
            continue
        fig.add_scatter(
            x=xs[part],
            y=ys[part],
            mode="markers+text" if text is not None else "markers",
            text=None if text is None else text[part],
            textfont=dict(size=10, color="white"),
            hovertext=hover[part],
            hovertemplate="%{hovertext}<extra></extra>",
            name=name,
            # plain cells need no legend entry; the red outline does
            showlegend=name != "ranks",
            # each cell's rank, so whoever reads the figure's data need not invert the grid arithmetic
            customdata=ranks[part],
            marker=dict(
                symbol="square", size=size, color=gid[part], colorscale=scale, cmin=cmin, cmax=cmax, line=outline
            ),
        )
    inner = [d for d in layout.inner_first if layout.size(d) > 1]
    # cells at integer columns: half a cell of margin each side
    fig.update_xaxes(visible=False, range=[-0.6, cols - 0.4])
    # row 0 on top, and square cells (scaleanchor): the grid reads as rank = row·columns + column
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor="x", scaleratio=1)
    title = f"Mesh {layout.describe()} ({layout.order}): {len(groups)} {label} group(s) of {len(groups[0])}" + (
        f", {len(spanning)} span hosts" if spanning else ""
    )
    fig.add_annotation(
        text=f"rank = row·{cols} + column; inner dims first: {'-'.join(inner) or '-'}",
        showarrow=False,
        x=0,
        y=-0.08,
        xref="paper",
        yref="paper",
        xanchor="left",
        font=dict(size=10, color="#666"),
    )
    return _layout(fig, title)
