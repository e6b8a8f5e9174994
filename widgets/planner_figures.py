"""The planner's answers drawn: what each layout sends over NVLink and across nodes (Plan.links()),
where a job's layout ranks among the planner's alternatives, and which dims of a mesh cross nodes.
Pure: Plans, Rows or a MeshLayout in, a go.Figure out."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.config.table import Rows
from labkit.layout.mesh import SUB_DIMS, MeshLayout
from labkit.theory.planner.links import crossing
from labkit.widgets.style import GRID, INK, Palette, _figure, _layout, dim_color, shade

LINKS = ("inside a node", "across nodes")
UNITS = {"GB": 1.0, "MB": 1e3, "kB": 1e6}
"""Display units of links_figure, from the rows' GB (1e9 bytes, as Plan.links() reports)."""


def link_rows(source) -> list[dict]:
    """The per-dim rows of a Plan (Plan.links()) or of Rows in its schema, without the 'total' row."""
    rows = source.links() if hasattr(source, "links") else source
    return [r for r in rows if r["dim"] != "total"]


def run_links(result, ranks_per_node: int, rank: int = 0) -> Rows:
    """Plan.links()'s rows for one rank of a run on the cluster, as if every `ranks_per_node`
    consecutive ranks shared a node: per comm dim, the wire bytes it sent per step (comm_table()) and
    the part that crosses nodes by the planner's own rule (theory/planner/links.py, `crossing`)."""
    layout = MeshLayout.of(result.config)
    per_dim: dict[str, list[float]] = {}
    for row in result.comm_table():
        if row["rank"] != rank:
            continue
        group = layout.group_of(rank, *row["dim"].split("-"))
        acc = per_dim.setdefault(row["dim"], [0.0, 0.0])
        acc[0] += row["wire_bytes"]
        acc[1] += row["wire_bytes"] * crossing(row["op"], group, rank, ranks_per_node)
    return Rows(
        {
            "rank": rank,
            "dim": dim,
            "GB sent": wire / 1e9,
            "GB over NVLink": (wire - across) / 1e9,
            "GB across nodes": across / 1e9,
        }
        for dim, (wire, across) in per_dim.items()
    )


def links_figure(candidates: dict, unit: str = "GB") -> go.Figure:
    """Per candidate (label -> Plan, or Rows in Plan.links()' schema): what its busiest rank sends per
    step inside a node (NVLink at scale) and across nodes, one bar each, stacked by dim."""
    scale = UNITS[unit]
    rows = {name: link_rows(src) for name, src in candidates.items()}
    dims = list(dict.fromkeys(r["dim"] for rs in rows.values() for r in rs))
    # two bars per candidate, its name over both: a two-level category axis
    y = [[name for name in rows for _ in LINKS], [link for _ in rows for link in LINKS]]
    fig = _figure()
    colors = Palette()
    for dim in dims:
        by = {name: next((r for r in rs if r["dim"] == dim), None) for name, rs in rows.items()}
        x = [
            (by[name][key] * scale if by[name] else 0.0)
            for name in rows
            for key in ("GB over NVLink", "GB across nodes")
        ]
        fig.add_bar(
            name=dim,
            x=x,
            y=y,
            orientation="h",
            marker_color=colors(dim, dim_color(dim)),
            hovertemplate=f"{dim}: %{{x:,.3g}} {unit}<extra>%{{y}}</extra>",
        )
    across = {name: sum(r["GB across nodes"] for r in rs) * scale for name, rs in rows.items()}
    least = min(across, key=across.get)
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_xaxes(title=f"{unit} sent per step by the busiest rank", gridcolor=GRID)
    sent = {name: sum(r["GB sent"] for r in rs) * scale for name, rs in rows.items()}
    # one layout (the ScaleExplorer's): how much of what it sends crosses; several: which crosses least
    why = (
        f"{least}: {across[least]:,.3g} of the {sent[least]:,.3g} {unit} it sends cross nodes"
        if len(rows) == 1
        else f"least across nodes: {least} ({across[least]:,.3g} {unit})"
    )
    title = f"What crosses nodes: {unit} per step, inside a node and across, by dim<br><sup>{why}</sup>"
    return _layout(
        fig,
        title,
        barmode="stack",
        height=160 + 60 * len(rows),
        margin=dict(l=60, r=20, t=120, b=50),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
    )


def _wrapped(text: str, width: int = 44) -> str:
    """A layout's line broken at its ' · ' into lines of about `width` characters: the bars keep the
    cell's width instead of the labels taking most of it."""
    lines = [""]
    for part in text.split(" · "):
        if lines[-1] and len(lines[-1]) + 3 + len(part) > width:
            lines.append(part)
        else:
            lines[-1] = f"{lines[-1]} · {part}" if lines[-1] else part
    return "<br>".join(lines)


def alternatives_figure(plans, own, own_label: str = "your layout") -> go.Figure:
    """The planner's alternatives (theory.plan's list, best first) and a job's own layout (a Plan,
    theory.evaluate) as one ranked bar chart of predicted tokens/s/GPU, the job's bar marked."""
    entries = [(p, False) for p in plans] + [(own, True)]
    # ranked by tokens/s/GPU; the planner's list is already in that order, the job's plan joins where it falls
    entries.sort(key=lambda e: -e[0].tokens_per_second_per_gpu)
    place = next(i for i, (_, mine) in enumerate(entries, 1) if mine)
    labels = [
        _wrapped(f"#{i} {'▶ ' + own_label + ': ' if mine else ''}{p.layout()}")
        for i, (p, mine) in enumerate(entries, 1)
    ]
    fig = _figure()
    colors = Palette()
    for mine, name, color in ((False, "the planner's alternatives", "#9DB4CC"), (True, own_label, "#D55E00")):
        picked = [(label, p) for label, (p, m) in zip(labels, entries) if m == mine]
        fig.add_bar(
            name=name,
            y=[label for label, _ in picked],
            x=[p.tokens_per_second_per_gpu for _, p in picked],
            orientation="h",
            marker_color=colors(name, color),
            text=[f"MFU {p.mfu:.0%}" + ("" if p.fits else ", does not fit") for _, p in picked],
            textposition="inside",
            customdata=[f"{p.peak_bytes / 2**30:,.1f} GiB, {p.bound}-bound" for _, p in picked],
            hovertemplate="%{x:,.0f} tokens/s/GPU, %{customdata}<extra>%{y}</extra>",
        )
    fig.update_yaxes(categoryorder="array", categoryarray=labels, autorange="reversed", automargin=True)
    fig.update_xaxes(title="predicted tokens/s/GPU", gridcolor=GRID)
    title = (
        f"{own_label} ranks #{place} of {len(entries)} by predicted tokens/s/GPU"
        f"<br><sup>on {own.hardware.split(' (')[0]}: {own.tokens_per_second_per_gpu:,.0f} against the best's "
        f"{entries[0][0].tokens_per_second_per_gpu:,.0f}</sup>"
    )
    return _layout(
        fig,
        title,
        barmode="overlay",
        height=140 + 52 * len(entries),
        margin=dict(l=60, r=20, t=110, b=50),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
    )


def group_crossings(layout: MeshLayout, ranks_per_node: int) -> list[dict]:
    """Per dim of size > 1 (HSDP's dp_shard and dp_replicate in dp's place): its groups, how many of
    them span more than one node, and how many nodes its widest group spans."""
    hosts = [r // ranks_per_node for r in range(layout.world)]
    dims = [d for d in layout.fine_inner_first if layout.size(d) > 1]
    if layout.dp_replicate > 1:
        dims = [d for d in dims if d != "dp"]  # shown as its two halves
    else:
        dims = [d for d in dims if d not in SUB_DIMS]
    out = []
    for d in dims:
        groups = layout.groups(d)
        nodes = [len({hosts[r] for r in g}) for g in groups]
        out.append(
            {"dim": d, "groups": len(groups), "across nodes": sum(n > 1 for n in nodes), "nodes per group": max(nodes)}
        )
    return out


def group_crossings_figure(layout: MeshLayout, ranks_per_node: int) -> go.Figure:
    """Every dim of a mesh: how many of its groups stay inside one node and how many span nodes (their
    collectives then run on the slow inter-node network), one bar per dim in its colour."""
    rows = group_crossings(layout, ranks_per_node)
    fig = _figure()
    colors = Palette()
    for r in rows:
        inside = r["groups"] - r["across nodes"]
        for part, n, k in (("inside a node", inside, 0), ("across nodes", r["across nodes"], 3)):
            fig.add_bar(
                name=f"{r['dim']} {part}",
                y=[r["dim"]],
                x=[n],
                orientation="h",
                marker=dict(
                    color=colors(f"{r['dim']} {part}", shade(dim_color(r["dim"]), k)), pattern_shape="/" if k else ""
                ),
                text=[f"{n:,}"],
                customdata=[r["nodes per group"]],
                hovertemplate=f"{r['dim']}: %{{x:,}} group(s) {part}; the widest spans %{{customdata}} node(s)"
                "<extra></extra>",
                showlegend=False,
            )
    crossing_dims = [r["dim"] for r in rows if r["across nodes"]]
    fig.update_yaxes(autorange="reversed", automargin=True, title="dim, innermost first")
    fig.update_xaxes(title="groups (solid: inside one node, hatched: across nodes)", gridcolor=GRID, linecolor=INK)
    nodes = -(-layout.world // ranks_per_node)
    title = (
        f"Which dims cross nodes: {', '.join(crossing_dims) or 'none'}"
        f"<br><sup>{layout.describe()} ({layout.order}) on {nodes:,} nodes of {ranks_per_node}</sup>"
    )
    return _layout(fig, title, barmode="stack", height=160 + 40 * len(rows), margin=dict(l=60, r=20, t=90, b=50))
