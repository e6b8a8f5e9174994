"""Pipeline parallelism, predicted: the bubble, microbatches in flight, which parameters each
pipeline rank holds, and the point-to-point bytes per step. The schedules and their simulator
are plans (labkit/plans/schedules.py, simulator.py); this module reads them. The bubble is
GPipe's and 1F1B's (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al., SC 2021, section 2.1),
interleaved 1F1B's (p-1)/(v·m+p-1) (ibid., section 2.2). The derivations: ARCHITECTURE.md.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.precision import ELEM, REDUCE
from labkit.plans.schedules import chunk_layers, plan, rank_chunk_of, stage_of, stage_sizes
from labkit.plans.simulator import Costs, Simulation, simulate
from labkit.theory.batch import microbatch_rows, stream_rows
from labkit.theory.model import param_shapes


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
    while any of them is in flight (theory/activations.py: the zigzag positions)."""
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
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    return peak_in_flight(plan(schedule, p, m, v).actions[rank], lambda mb, chunk: 1)


@lru_cache(maxsize=256)
def chunk_full_shapes(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[list[tuple[str, tuple]]]:
    """(name, full shape) of the model's parameters in each of this pipeline rank's chunks, in
    the order the engines register them: the embedding on virtual stage 0, the final norm and
    head on the last, the blocks evenly in between. One list of every parameter when pp == 1.
    (theory/params.py `chunk_local_params` slices them as the rank holds them.)"""
    shapes = param_shapes(model)
    if cfg.pp == 1:
        return [shapes]
    p, v = cfg.pp, cfg.virtual_stages
    out = []
    for c in range(v):
        s = stage_of(pp_rank, c, p)
        blocks = {str(i) for i in chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers)}
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


def rank_params(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Parameters held by one pipeline rank (all of its chunks), before any other split."""
    return sum(prod(s) for chunk in chunk_full_shapes(cfg, model, pp_rank) for _, s in chunk)


def stage_layers(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> tuple[int, bool, bool]:
    """(blocks a rank at pipeline coordinate `pp_rank` holds, whether it holds the embedding
    (virtual stage 0), whether it holds the head (the last virtual stage))."""
    if cfg.pp == 1:
        return model.layers, True, True
    p, v = cfg.pp, cfg.virtual_stages
    stages = [stage_of(pp_rank, c, p) for c in range(v)]
    layers = sum(len(chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers)) for c in range(v))
    return layers, 0 in stages, p * v - 1 in stages


def p2p_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Sends and receives of one step, per rank: for each microbatch and each of the rank's
    chunks, its output activation forward (unless it is the last stage) and its input's
    gradient backward (unless it is the first), each (b, s/cp, h) — s/(cp·tp) under SP — in the
    compute dtype (each tp rank passes its rows to the same tp rank of the next stage)."""
    if cfg.pp == 1:
        return
    p, v, m = cfg.pp, cfg.virtual_stages, cfg.microbatches
    nbytes = microbatch_rows(cfg) * stream_rows(cfg, model) * model.hidden * ELEM[cfg.precision]
    label = layout.label("pp")
    for rank in comm.ranks(layout):
        r = layout.coords(rank)["pp"]
        for c in range(v):
            s = stage_of(r, c, p)
            if s < p * v - 1:  # activation out, its gradient back in
                comm.add(rank, label, "send", nbytes, p, calls=m)
                comm.add(rank, label, "recv", nbytes, p, calls=m)
            if s > 0:  # activation in, its gradient back out
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
    return {rank_chunk_of(s, cfg.pp): n / mean for s, n in enumerate(sizes)}


def simulated(
    cfg: ParallelConfig, costs: dict | None = None, schedule: str | None = None, layers: int | None = None
) -> Simulation:
    """The simulator's ideal timeline of `cfg`'s schedule (labkit/plans/simulator.py): unit
    costs by default, or measured ones (`costs_from_result(result)`); with uneven stages
    (cfg.stage_layers, given the model's `layers`) each chunk's compute in proportion to its layers."""
    pl = plan(schedule or cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    scale = stage_scale(cfg, layers) if layers and cfg.stage_layers else None
    return simulate(pl, Costs(**(costs or {}), scale=scale))


def step_bubble(cfg: ParallelConfig, model: ModelConfig) -> float:
    """The bubble of one step: the formula on even stages (`bubble_fraction`), the simulator's
    mean idle fraction on uneven ones (the slowest stage sets the pace)."""
    if cfg.pp > 1 and stage_scale(cfg, model.layers) is not None:
        return simulated(cfg, layers=model.layers).bubble
    return bubble_fraction(cfg.pp, cfg.microbatches, cfg.virtual_stages)
