"""Expert parallelism drawn: the rows each rank's experts receive step by step (the load the
aux-loss-free bias moves from rank to rank), the busiest rank over the mean, the routers' biases,
and the tokens a routing sends across nodes with and without DeepSeek-V3's group limit. Pure: runs
(RunResult, from their comm logs) or routings (arrays of chosen experts) in, a go.Figure out."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.widgets.style import GRID, INK, Palette, _figure, _layout, rank_color, shade

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def expert_rows(result) -> np.ndarray:
    """Rows each rank's experts received in each MoE layer's forward, per step: (steps, MoE layers, ranks).

    Read off the comm log (engines/parallel/experts.py): per MoE layer and microbatch a rank runs the
    counts' all-to-all (integers), the dispatch and the combine; the combine sends back what its experts
    received, so its payload over hidden · itemsize is that many rows. Microbatches add up per layer."""
    cfg, model = result.config, result.model
    if cfg.pp > 1:  # a pipeline rank holds some MoE layers only: the layer of a combine is not its index
        raise ValueError(f"expert_rows reads a run without a pipeline (pp={cfg.pp})")
    layers = model.moe_layers
    out = np.zeros((result.steps, layers, len(result.ranks)))
    for i, rk in enumerate(result.ranks):
        for step in range(result.steps):
            rows = [
                c
                for c in rk.comm
                if c.op == "all_to_all" and c.phase == "forward" and c.step == step and c.dtype in ITEMSIZE
            ]
            # dispatch, combine, dispatch, combine, ...: microbatch by microbatch, layer by layer
            for j, c in enumerate(rows[1::2]):
                out[step, j % layers, i] += c.payload_bytes / (model.hidden * ITEMSIZE[c.dtype])
    return out


def imbalance(rows: np.ndarray) -> np.ndarray:
    """Busiest rank over the mean, per step and MoE layer: (steps, layers), from expert_rows. The step
    waits for the busiest rank's experts, so this is what the imbalance costs in time."""
    return rows.max(axis=2) / rows.mean(axis=2)


def expert_load_figure(runs: dict) -> go.Figure:
    """Per run (label -> RunResult with experts over ep, return_params=True for the biases): a heatmap
    of the rows each rank received, step by step and block by block ('b1 r0': block 1, rank 0), all on
    one colour scale; below, the busiest rank over the mean per step (each point coloured by the rank
    that was busiest) and each router's bias after the last step."""
    rows = {name: expert_rows(r) for name, r in runs.items()}
    first = next(iter(runs.values()))
    ranks, layers = len(first.ranks), first.model.moe_layers
    top = max(float(r.max()) for r in rows.values())
    dense = first.model.dense_layers  # the MoE layers are the blocks after the first `dense` ones
    blocks = [f"b{dense + i}" for i in range(layers)]
    # a frozen bias is zero: its bars would be empty, so the panel's title says so instead
    frozen = [name for name, r in runs.items() if not any(np.any(b) for b in (r.buffers or {}).values())]
    n = len(runs)
    cols = max(n, 2)  # the second row holds two panels whatever the runs
    half = cols // 2
    top_row = [{}] * n + [None] * (cols - n) if n > 1 else [{"colspan": cols}] + [None] * (cols - 1)
    bottom_row = [{"colspan": half}] + [None] * (half - 1) + [{"colspan": cols - half}] + [None] * (cols - half - 1)
    fig = make_subplots(
        rows=2,
        cols=cols,
        specs=[top_row, bottom_row],
        row_heights=[0.55, 0.45],
        vertical_spacing=0.16,
        horizontal_spacing=0.08,
        subplot_titles=[
            *runs,
            "busiest rank / mean, per step",
            "router bias after the last step" + (f" ({', '.join(frozen)}: all zero)" if frozen else ""),
        ],
    )
    labels = [f"{b} r{r}" for b in blocks for r in range(ranks)]
    for col, (name, got) in enumerate(rows.items(), 1):
        z = got.reshape(got.shape[0], -1)  # (steps, layers · ranks), layer-major as the labels
        fig.add_heatmap(
            z=z,
            x=labels,
            y=[f"step {s}" for s in range(got.shape[0])],
            zmin=0,
            zmax=top,
            colorscale="Blues",
            showscale=col == n,
            colorbar=dict(title="rows", len=0.5, y=0.78),
            texttemplate="%{z:.0f}",
            hovertemplate="%{y}, block and rank %{x}: %{z:.0f} rows<extra>" + name + "</extra>",
            name=name,
            row=1,
            col=col,
        )
        fig.update_yaxes(autorange="reversed", row=1, col=col)
    colors = Palette()
    # one legend entry per rank: the colour a point takes when that rank is the busiest
    for r in range(ranks):
        fig.add_scatter(
            x=[None],
            y=[None],
            mode="markers",
            name=f"busiest: r{r}",
            marker=dict(size=9, color=colors(f"r{r}", rank_color(r))),
        )
    dashes = ("solid", "dot", "dash", "dashdot")
    for k, (name, got) in enumerate(rows.items()):
        ratio = imbalance(got)
        busiest = got.argmax(axis=2)
        for layer in range(layers):
            fig.add_scatter(
                x=list(range(got.shape[0])),
                y=ratio[:, layer],
                name=f"{name}, {blocks[layer]}",
                mode="lines+markers",
                line=dict(
                    color=colors(f"{name}, {blocks[layer]}", ["#4D4D4D", "#A0A0A0"][k % 2]), dash=dashes[layer % 4]
                ),
                marker=dict(size=9, color=[rank_color(int(b)) for b in busiest[:, layer]]),
                customdata=busiest[:, layer],
                hovertemplate="step %{x}: busiest r%{customdata} has %{y:.2f} × the mean<extra>" + name + "</extra>",
                row=2,
                col=1,
            )
    fig.update_xaxes(title="step", dtick=1, row=2, col=1)
    fig.update_yaxes(title="busiest / mean", row=2, col=1)
    bias_col = half + 1
    # the bias of each MoE layer's router (RunResult.buffers, return_params=True): zero while frozen
    for name, r in runs.items():
        if name in frozen:
            continue
        for key, b in sorted((r.buffers or {}).items()):
            layer = "b" + key.split(".mlp")[0].split(".")[-1]  # 'blocks.1.mlp.expert_bias' -> 'b1'

            fig.add_bar(
                x=[f"e{e}" for e in range(len(b))],
                y=np.asarray(b, dtype=float).reshape(-1),
                name=f"{name}, {layer} bias",
                marker_color=colors(f"{name}, {layer} bias", "#72B7B2"),
                hovertemplate="expert %{x}: bias %{y:.3f}<extra>" + f"{name}, {layer}" + "</extra>",
                row=2,
                col=bias_col,
            )
    fig.update_xaxes(title="expert", row=2, col=bias_col)
    fig.update_yaxes(title="bias", row=2, col=bias_col)
    fig.update_xaxes(gridcolor=GRID)
    fig.update_yaxes(gridcolor=GRID)
    swing = {name: float(imbalance(got).max()) for name, got in rows.items()}
    worst = max(swing, key=swing.get)
    title = (
        "Rows each rank's experts receive, step by step: which rank the load lands on"
        f"<br><sup>busiest rank up to {swing[worst]:.2f} × the mean ({worst})</sup>"
    )
    return _layout(fig, title, height=640, barmode="group", margin=dict(l=60, r=20, t=100, b=60))


def token_crossings(chosen: np.ndarray, experts_per_rank: int, ranks_per_node: int, seqs_per_rank: int) -> dict:
    """What one MoE layer's routing sends across nodes, from its chosen experts (b, s, k): rank r routes
    sequences r·seqs_per_rank onwards, expert e lives on rank e // experts_per_rank, node = rank //
    ranks_per_node. 'rows across nodes': assignments whose expert is on another node (labkit's dispatch
    sends one row each); 'tokens across nodes': tokens with at least one (DeepEP sends such a token once
    per node it reaches); 'tokens reaching 2+ nodes': tokens whose experts sit on more than one node."""
    chosen = np.asarray(chosen)
    dest = chosen // experts_per_rank  # (b, s, k): the rank holding each chosen expert
    source = (np.arange(chosen.shape[0]) // seqs_per_rank).reshape(-1, 1, 1)  # (b, 1, 1): the routing rank
    away = dest // ranks_per_node != source // ranks_per_node
    node = dest // ranks_per_node
    # a token reaches as many nodes as its k destinations have distinct nodes
    reached = np.array([[len(set(t)) for t in seq] for seq in node.tolist()])
    return {
        "rows": int(chosen.size),
        "rows across nodes": int(away.sum()),
        "tokens across nodes": int(away.any(-1).sum()),
        "tokens reaching 2+ nodes": int((reached > 1).sum()),
    }


def token_crossing_figure(crossings: dict) -> go.Figure:
    """Per routing (label -> one token_crossings dict per MoE layer): the tokens that leave their node
    and the tokens that reach more than one node, layer by layer."""
    fig = _figure()
    colors = Palette()
    prefer = ("#0072B2", "#D55E00", "#009E73", "#CC79A7")
    for k, (name, per_layer) in enumerate(crossings.items()):
        x = [f"MoE layer {i + 1}" for i in range(len(per_layer))]
        # a routing's two counts in its colour: the tokens that leave solid, those reaching 2+ nodes hatched
        for what, pattern, lighter in (("tokens across nodes", "", 0), ("tokens reaching 2+ nodes", "/", 1)):
            fig.add_bar(
                x=x,
                y=[c[what] for c in per_layer],
                name=f"{name}: {what}",
                marker=dict(color=colors(f"{name}: {what}", shade(prefer[k % 4], lighter)), pattern_shape=pattern),
                customdata=[c["rows across nodes"] for c in per_layer],
                hovertemplate=f"{name}: %{{y}} {what} (%{{customdata}} rows across)<extra>%{{x}}</extra>",
            )
    total = {name: sum(c["tokens reaching 2+ nodes"] for c in per) for name, per in crossings.items()}
    title = (
        "Tokens that leave their node, per MoE layer<br><sup>"
        + "; ".join(f"{name}: {n} token(s) reach 2+ nodes" for name, n in total.items())
        + "</sup>"
    )
    fig.update_yaxes(title="tokens", gridcolor=GRID, linecolor=INK)
    return _layout(fig, title, barmode="group", height=380, margin=dict(l=60, r=20, t=90, b=50))
