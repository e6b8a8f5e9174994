"""Pipeline parallelism, predicted: the bubble, microbatches in flight, which parameters each
pipeline rank holds, the point-to-point bytes per step, and what a split backward's W holds.
The schedules and their simulator are the layout's (labkit/layout/schedules.py, simulator.py); this
module reads them. The bubble is GPipe's and 1F1B's (p-1)/(m+p-1) (Huang et al. 2019;
Narayanan et al., SC 2021, section 2.1), interleaved 1F1B's (p-1)/(v·m+p-1) (ibid., section
2.2); the zero-bubble schedules' is the simulator's with t_F = t_B = t_W (`step_bubble`; their
published formulas: DERIVATIONS.md, "Zero-bubble schedules"). The derivations: DERIVATIONS.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.choices import pipeline_shape
from labkit.layout.precision import ELEM, REDUCE
from labkit.layout.schedules import chunk_layers, rank_chunk_of, schedule_table, stage_of, stage_sizes, style
from labkit.layout.simulator import Costs, Simulation, simulate
from labkit.theory.exact.batch import microbatch_rows, stream_rows
from labkit.theory.exact.latent import matmul_widths
from labkit.theory.exact.model import param_shapes


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage: (p - 1) / (v·m + p - 1) — GPipe and 1F1B (v = 1) and
    interleaved 1F1B with v chunks per rank. 0 without a pipeline."""
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)


def peak_in_flight(
    actions,
    kept: Callable[[int, int], int],
    extra: Callable[[int, int], int] | None = None,
    shared: int = 0,
    first: tuple[int, ...] = (),
) -> int:
    """Peak of what a rank's microbatches keep alive while it runs `actions` in order: each F of
    (microbatch, chunk) adds kept(mb, chunk), the action that ends its backward (W if backward
    is split, else B) frees it, and a B adds extra(mb, chunk) on top for as long as it runs.
    `shared` bytes are one tensor for every microbatch of the chunks in `first`: counted once
    while any of them is in flight (theory/exact/activations.py: the zigzag positions)."""
    frees = "W" if any(a.op == "W" for a in actions) else "B"
    alive = top = holding = 0  # holding: microbatches of a `first` chunk in flight
    for a in actions:
        if a.op == "F":
            alive += kept(a.mb, a.chunk)
            holding += a.chunk in first
            top = max(top, alive + (shared if holding else 0))
        elif a.op == "B" and extra is not None:
            top = max(top, alive + (shared if holding else 0) + extra(a.mb, a.chunk))
        if a.op == frees:
            alive -= kept(a.mb, a.chunk)
            holding -= a.chunk in first
    return top


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Most microbatches (of one chunk, counted per chunk for interleaved) whose activations
    rank r holds at once: GPipe m, 1F1B min(m, p - r); others by walking the schedule."""
    shape = pipeline_shape(schedule)
    if shape.forwards_first:
        return m
    if shape.one_f_one_b:
        return min(m, p - rank)
    return peak_in_flight(schedule_table(schedule, p, m, v).actions[rank], lambda mb, chunk: 1)


@lru_cache(maxsize=256)
def chunk_full_shapes(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[list[tuple[str, tuple]]]:
    """(name, full shape) of the model's parameters in each of this pipeline rank's chunks, in
    the order the engines register them: the embedding on virtual stage 0, the final norm and
    head on the last, the blocks evenly in between. One list of every parameter when pp == 1.
    (theory/exact/params.py `chunk_local_params` slices them as the rank holds them.)"""
    shapes = param_shapes(model)
    if cfg.pp == 1:
        return [shapes]
    p, v = cfg.pp, cfg.virtual_stages
    out = []
    for c in range(v):
        s = stage_of(pp_rank, c, p, style(cfg.schedule))
        blocks = {str(i) for i in chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers, style(cfg.schedule))}
        chunk = [
            (n, sh)
            for n, sh in shapes
            if (n.startswith("embed.") and s == 0)
            or (n.startswith("head.") and s == p * v - 1)
            or (n.startswith("blocks.") and n.split(".", 2)[1] in blocks)
        ]
        if model.tied and s == p * v - 1:  # the head's copy of the tied embedding, registered last
            chunk.append(("embed.tok.weight", (model.vocab, model.hidden)))
        out.append(chunk)
    return out


def full_param_count(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Parameters held by one pipeline rank (all of its chunks), before any other split."""
    return sum(prod(s) for chunk in chunk_full_shapes(cfg, model, pp_rank) for _, s in chunk)


def stage_layers(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> tuple[int, bool, bool]:
    """(blocks a rank at pipeline coordinate `pp_rank` holds, whether it holds the embedding
    (virtual stage 0), whether it holds the head (the last virtual stage))."""
    if cfg.pp == 1:
        return model.layers, True, True
    p, v, placement = cfg.pp, cfg.virtual_stages, style(cfg.schedule)
    stages = [stage_of(pp_rank, c, p, placement) for c in range(v)]
    layers = sum(len(chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers, placement)) for c in range(v))
    return layers, 0 in stages, p * v - 1 in stages


def p2p_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Sends and receives of one step, per rank: for each microbatch and each of the rank's
    chunks, its output activation forward (unless it is the last stage) and its input's
    gradient backward (unless it is the first), each (b, s/cp, h) — s/(cp·tp) under SP — in the
    compute dtype (each tp rank passes its rows to the same tp rank of the next stage). A V's
    turn (stages p-1 and p, both on rank p-1) sends nothing."""
    if cfg.pp == 1:
        return
    p, v, m, placement = cfg.pp, cfg.virtual_stages, cfg.microbatches, style(cfg.schedule)
    nbytes = microbatch_rows(cfg) * stream_rows(cfg, model) * model.hidden * ELEM[cfg.precision]
    label = layout.label("pp")
    for rank in comm.ranks(layout):
        r = layout.coords(rank)["pp"]
        for c in range(v):
            s = stage_of(r, c, p, placement)
            if s < p * v - 1 and rank_chunk_of(s + 1, p, placement)[0] != r:  # activation out, its gradient back in
                comm.add(rank, label, "send", nbytes, p, calls=m)
                comm.add(rank, label, "recv", nbytes, p, calls=m)
            if s > 0 and rank_chunk_of(s - 1, p, placement)[0] != r:  # activation in, its gradient back out
                comm.add(rank, label, "recv", nbytes, p, calls=m)
                comm.add(rank, label, "send", nbytes, p, calls=m)


def tied_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """A tied embedding under pp: the first and the last stage each hold a copy and all-reduce its
    gradient over the two of them once per step, (V/tp, h) in fp32 (engines/parallel/common.py
    all_reduce_tied; Megatron-LM's embedding group)."""
    if not model.tied or cfg.pp == 1:
        return
    nbytes = REDUCE * model.vocab // cfg.tp * model.hidden
    label = layout.label("pp")
    for rank in comm.ranks(layout):
        if layout.coords(rank)["pp"] in (0, cfg.pp - 1):
            comm.add(rank, label, "all_reduce", nbytes, 2)


def costs_from_result(result, step: int = -1) -> dict:
    """Measured seconds per pipeline rank, for the simulator's Costs(**...): the mean F, B (and
    W) span, over data-parallel replicas too, and as t_comm the fastest receive (one that did
    not have to wait: transfer, not bubble). Kinds never measured cost 0."""
    wanted = step % result.steps
    spans: dict[str, dict[int, list[float]]] = {k: {} for k in ("F", "B", "W", "recv")}
    for rk in result.ranks:
        for e in rk.timeline:
            if e.step == wanted and e.kind in spans:
                spans[e.kind].setdefault(rk.coords["pp"], []).append(e.end - e.start)
    out: dict = {}
    for kind, name in (("F", "F"), ("B", "B"), ("W", "W"), ("recv", "comm")):
        per = spans[kind]
        pick = min if kind == "recv" else (lambda xs: sum(xs) / len(xs))
        out[name] = {r: pick(per[r]) if per.get(r) else 0.0 for r in range(result.config.pp)} if per else 0.0
    return out


def stage_scale(cfg: ParallelConfig, layers: int) -> dict | None:
    """{(rank, chunk): its layers / the mean layers per stage}: what uneven stages
    (cfg.stage_layers) cost relative to even ones, for the simulator; None when they are even."""
    sizes = stage_sizes(layers, cfg.pp * cfg.virtual_stages, cfg.stage_layers)
    if len(set(sizes)) <= 1:
        return None
    mean = sum(sizes) / len(sizes)
    return {rank_chunk_of(s, cfg.pp, style(cfg.schedule)): n / mean for s, n in enumerate(sizes)}


def simulated(
    cfg: ParallelConfig, costs: dict | None = None, schedule: str | None = None, layers: int | None = None
) -> Simulation:
    """The simulator's ideal timeline of `cfg`'s schedule (labkit/layout/simulator.py): unit
    costs by default, or measured ones (`costs_from_result(result)`); with uneven stages
    (cfg.stage_layers, given the model's `layers`) each chunk's compute in proportion to its layers."""
    table = schedule_table(schedule or cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    scale = stage_scale(cfg, layers) if layers and cfg.stage_layers else None
    return simulate(table, Costs(**(costs or {}), scale=scale))


def step_bubble(cfg: ParallelConfig, model: ModelConfig) -> float:
    """The bubble of one step: the formula on even stages (`bubble_fraction`), the simulator's
    mean idle fraction on uneven ones (the slowest stage sets the pace) and for the zero-bubble
    schedules (with t_F = t_B = t_W: a transformer's forward, input-gradient and weight-gradient
    matmuls cost the same, 2·b·s·h·h' FLOPs each)."""
    if cfg.pp > 1 and (cfg.pipeline.splits_backward or stage_scale(cfg, model.layers) is not None):
        return simulated(cfg, layers=model.layers).bubble
    return bubble_fraction(cfg.pp, cfg.microbatches, cfg.virtual_stages)


# -- what W holds: the gradients B keeps for it ------------------------------------------------
def held_bytes(cfg: ParallelConfig, model: ModelConfig, layers: int, head: bool, embed: bool) -> int:
    """Bytes a split backward's B keeps for W, for one microbatch of a chunk with `layers`
    blocks (engines/parallel/pipeline/split_backward.py): the gradient flowing into every node where a
    weight's gradient branches off the input's path — each Linear's output gradient, each norm's
    output gradient — in the compute dtype (llama's RMSNorm: fp32, it runs upcast). The first
    stage keeps nothing (no input gradient to compute: its W is the whole backward). Per block,
    with b sequences, s positions (s/cp), t = tp, rows s' (s/t under SP) and kv the rank's K/V
    width: norms 2·b·s'·h; q b·s·h/t, k and v 2·b·s·kv, the output projection b·s·h (a
    row-parallel output is whole before its reduction); the MLP b·s·f/t and b·s·h (SwiGLU 2·b·s·f/t
    and b·s·h), an MoE layer the router's b·s·E and its experts' N = b·s·k routed rows (balanced:
    R = N) times f + h (SwiGLU 2f + h); the head its norm b·s'·h and its projection b·s·V/t."""
    if embed:
        return 0
    b, s, t = microbatch_rows(cfg), model.seq // cfg.cp, cfg.tp
    h, f, e = model.hidden, model.ffn, ELEM[cfg.precision]
    rows = s // t if cfg.sequence_parallel else s
    norm = (4 if model.norms.rms else e) * b * rows * h
    kv = max(1, model.n_kv_heads // t) * model.head_dim
    attn = e * (b * s * h // t + 2 * b * s * kv + b * s * h)
    if model.family.latent_attention:  # MLA: its matmuls' output gradients, its latent norms' (fp32)
        attn = e * b * s * sum(matmul_widths(model, t)) + 4 * b * s * ((model.q_lora_rank or 0) + model.kv_lora_rank)
    gated = model.family.gated_mlp
    if model.experts:
        n = b * s * model.top_k
        mlp = e * (b * s * model.experts + n * ((2 if gated else 1) * f + h))
    else:
        mlp = e * ((2 if gated else 1) * b * s * f // t + b * s * h)
    total = layers * (2 * norm + attn + mlp)
    if head:
        total += norm + e * b * s * model.vocab // t
    return total


def held_peak(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Peak bytes B keeps for W on a rank at pipeline coordinate `pp_rank`: its schedule walked,
    each B adding its chunk's held_bytes, its W freeing them (0 when backward is not split)."""
    if cfg.pp == 1 or not cfg.pipeline.splits_backward:
        return 0
    p, v, placement = cfg.pp, cfg.virtual_stages, style(cfg.schedule)
    per = {}
    for c in range(v):
        s = stage_of(pp_rank, c, p, placement)
        layers = len(chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers, placement))
        per[c] = held_bytes(cfg, model, layers, head=s == p * v - 1, embed=s == 0)
    live = top = 0
    for a in schedule_table(cfg.schedule, p, cfg.microbatches, v).actions[pp_rank]:
        if a.op in ("B", "W"):
            live += per[a.chunk] if a.op == "B" else -per[a.chunk]
            top = max(top, live)
    return top
