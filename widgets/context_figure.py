"""The context-parallel kinds drawn (ParallelConfig.cp_kind: the ring, the all-gather, Ulysses,
hierarchical): what each sends on the cp group and how much of it the step waits for, against the
sequence length, at scale (the planner's numbers: theory.evaluate and Plan.links()); and, on the
cluster, the bytes each kind measured beside the theory's. Pure: Plans' rows or runs in, a go.Figure out."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit import theory
from labkit.config import CONTEXT_KINDS, ModelConfig
from labkit.config.table import Rows
from labkit.widgets.style import CP_KIND_COLORS, GRID, KIB, OP_COLORS, Palette, _layout

CP_DIMS = ("cp", "cp ring", "cp all-to-all")
"""The names Plan.links() gives the cp group's traffic (hierarchical CP's two levels apart)."""


def context_at_scale(
    model: ModelConfig, placements: dict, seqs, hardware: str = "h100", a2a: int = 2, kinds=CONTEXT_KINDS
) -> Rows:
    """One row per (placement, kind, sequence length): the planner's price of the placement's layout
    (label -> ParallelConfig with cp > 1) under each kind (hierarchical with runs of `a2a`): the GB the
    busiest rank sends on cp per step (Plan.links(): with dp > 1 the gradients go on dp-cp, so this is
    the attention's traffic alone), the part across nodes, the seconds of it the step waits for
    ('exposed cp'), and tokens/s/GPU."""
    out = []
    for where, base in placements.items():
        for kind in kinds:
            cfg = base.replace(cp_kind=kind, cp_a2a=a2a if kind == "hierarchical" else 1)
            for seq in seqs:
                plan = theory.evaluate(cfg, model.replace(seq=seq), hardware)
                cp = [r for r in plan.links() if r["dim"] in CP_DIMS]
                out.append(
                    {
                        "placement": where,
                        "kind": kind,
                        "seq": seq,
                        "GB sent": sum(r["GB sent"] for r in cp),
                        "GB across nodes": sum(r["GB across nodes"] for r in cp),
                        "exposed s": plan.breakdown["time"].get("exposed cp", 0.0),
                        "tokens/s/GPU": plan.tokens_per_second_per_gpu,
                    }
                )
    return Rows(out)


def best_kinds(rows) -> dict[tuple[str, int], str]:
    """(placement, seq) -> the kind with the most predicted tokens/s/GPU."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        key = (r["placement"], r["seq"])
        if key not in best or r["tokens/s/GPU"] > best[key]["tokens/s/GPU"]:
            best[key] = r
    return {k: r["kind"] for k, r in best.items()}


def _runs(pairs) -> str:
    """'ring (16k–128k)' or 'hierarchical (16k), ring (32k–128k)': each winner over its run of lengths."""
    out: list[list] = []
    for s, kind in pairs:
        if out and out[-1][0] == kind:
            out[-1][2] = s
        else:
            out.append([kind, s, s])
    k = lambda s: f"{s // 1024}k"  # noqa: E731
    return ", ".join(f"{kind} ({k(a)}{'–' + k(b) if b != a else ''})" for kind, a, b in out)


def context_scale_figure(rows, model_name: str = "") -> go.Figure:
    """Per placement (a column), the GB each kind sends on cp per step (solid: all of it; dotted: the
    part across nodes) and the seconds the step waits for it, against the sequence length."""
    rows = list(rows)
    places = list(dict.fromkeys(r["placement"] for r in rows))
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig = make_subplots(
        rows=2,
        cols=len(places),
        shared_xaxes=True,
        vertical_spacing=0.1,
        horizontal_spacing=0.08,
        subplot_titles=places,
    )
    colors = Palette()
    for col, where in enumerate(places, 1):
        for kind in kinds:
            mine = sorted((r for r in rows if r["placement"] == where and r["kind"] == kind), key=lambda r: r["seq"])
            seqs = [r["seq"] for r in mine]
            color = colors(kind, CP_KIND_COLORS.get(kind, "#4D4D4D"))
            # the ring and the all-gather send the same bytes: the ring wide beneath, the all-gather dashed on it
            width, dash = (5, "solid") if kind == "ring" else (2, "dash" if kind == "allgather" else "solid")
            common = dict(x=seqs, mode="lines+markers", legendgroup=kind, showlegend=col == 1)
            fig.add_scatter(
                y=[r["GB sent"] for r in mine],
                name=kind,
                line=dict(color=color, width=width, dash=dash),
                hovertemplate=f"{kind}: %{{y:,.1f}} GB on cp<extra>s = %{{x:,}}</extra>",
                row=1,
                col=col,
                **common,
            )
            fig.add_scatter(
                y=[r["exposed s"] for r in mine],
                name=f"{kind} exposed",
                line=dict(color=color, width=width, dash=dash),
                hovertemplate=f"{kind}: %{{y:,.3f}} s exposed<extra>s = %{{x:,}}</extra>",
                row=2,
                col=col,
                **{**common, "showlegend": False},
            )
    seqs = sorted({r["seq"] for r in rows})
    # sequence lengths double: a log axis spaces them evenly, a tick at each
    ticks = dict(type="log", tickvals=seqs, ticktext=[f"{s // 1024}k" for s in seqs], gridcolor=GRID)
    fig.update_xaxes(**ticks)
    fig.update_xaxes(title="sequence length", row=2)
    fig.update_yaxes(title="GB sent on cp per step", row=1, col=1)
    fig.update_yaxes(title="seconds exposed per step", row=2, col=1)
    fig.update_yaxes(gridcolor=GRID, rangemode="tozero")
    best = best_kinds(rows)
    winners = "; ".join(f"{where}: {_runs([(s, best[where, s]) for s in seqs])}" for where in places)
    title = (
        f"Which cp kind hides its traffic{' — ' + model_name if model_name else ''}: look at the seconds exposed"
        f"<br><sup>fastest by tokens/s/GPU — {winners}</sup>"
    )
    return _layout(fig, title, height=560, margin=dict(l=60, r=20, t=110, b=50))


def cp_traffic(result, rank: int = 0) -> dict[str, float]:
    """op -> wire bytes `rank` sent per step on the cp group, its gradient all-reduce left out (the
    attention's traffic): from a RunResult or a theory Estimate (both have comm_table())."""
    out: dict[str, float] = {}
    for r in result.comm_table():
        if r["rank"] == rank and r["dim"] == "cp" and r["op"] != "all_reduce":
            out[r["op"]] = out.get(r["op"], 0.0) + r["wire_bytes"]
    return out


def context_kinds_figure(kinds: dict, rank: int = 0) -> go.Figure:
    """Per kind (name -> (RunResult, its theory Estimate)): the bytes `rank` sent on cp in one step,
    measured beside the theory's, stacked by op; and the activations the fullest rank kept, both ways."""
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.12,
        subplot_titles=[f"rank {rank}'s cp traffic, one step (KiB)", "activations, fullest rank (KiB)"],
    )
    x = [[k for k in kinds for _ in (0, 1)], [side for _ in kinds for side in ("measured", "theory")]]
    sent = {k: (cp_traffic(res, rank), cp_traffic(est, rank)) for k, (res, est) in kinds.items()}
    ops = sorted({op for pair in sent.values() for side in pair for op in side})
    colors = Palette()
    for op in ops:
        fig.add_bar(
            name=op,
            x=x,
            y=[side.get(op, 0.0) / KIB for pair in sent.values() for side in pair],
            marker_color=colors(op, OP_COLORS.get(op, "#4D4D4D")),
            hovertemplate=f"{op}: %{{y:,.1f}} KiB<extra>%{{x}}</extra>",
            row=1,
            col=1,
        )
    acts = [
        v / KIB
        for res, est in kinds.values()
        for v in (max(rk.memory["activations"] for rk in res.ranks), max(m["activations"] for m in est.memory))
    ]
    fig.add_bar(
        name="activations",
        x=x,
        y=acts,
        marker_color=colors("activations", "#E45756"),
        hovertemplate="%{y:,.1f} KiB<extra>%{x}</extra>",
        row=1,
        col=2,
    )
    fig.update_yaxes(gridcolor=GRID)
    same = all(a == b for a, b in sent.values()) and acts[0::2] == acts[1::2]
    title = (
        "Each cp kind's bytes and activations, measured beside the theory"
        f"<br><sup>{'every bar equals its theory' if same else 'measured and theory differ: see the bars'}</sup>"
    )
    return _layout(
        fig,
        title,
        barmode="stack",
        height=420,
        margin=dict(l=60, r=20, t=100, b=80),
        legend=dict(orientation="h", yanchor="top", y=-0.25, x=0),
    )
