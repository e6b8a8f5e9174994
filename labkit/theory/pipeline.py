"""Pipeline parallelism, predicted: bubble, activations in flight, parameters and p2p bytes per stage.

Bubble: GPipe (Huang et al., NeurIPS 2019) and 1F1B (Narayanan et al., SC 2021, section 2.1)
idle (p-1)/(m+p-1) of the step; interleaved 1F1B with v chunks per rank (ibid., section 2.2)
(p-1)/(v·m+p-1). The schedules themselves (labkit/plans/schedules.py) and their
simulator give the same numbers from the action lists, and also for measured costs.

Activations in flight on pipeline rank r (ibid., section 2.1): GPipe keeps all m microbatches
until their backward, 1F1B at most p - r; interleaved and the rest are read off the schedule
by walking its actions (each F adds the chunk's bytes, each B — or W when backward is split —
frees them).

Point-to-point traffic: each microbatch crosses every stage boundary twice (its activation
forward, the activation's gradient backward), b·s·h elements each way; with v chunks a rank
has v boundaries, so v times the traffic of plain 1F1B. The tensor is the residual stream as
the rank holds it: s/cp positions under context parallelism, s/(cp·tp) under sequence
parallelism (each tp rank passes its rows to the same tp rank of the next stage), in the
compute dtype.
"""
from __future__ import annotations

from functools import lru_cache

from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.precision import ELEM
from labkit.plans.schedules import chunk_layers, plan, stage_of
from labkit.theory.model import param_shapes


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage: (p - 1) / (v·m + p - 1) — GPipe and 1F1B (v = 1) and
    interleaved 1F1B with v chunks per rank. 0 without a pipeline."""
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)


def in_flight(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Most microbatches (of one chunk, counted per chunk for interleaved) whose activations
    rank r holds at once: GPipe m, 1F1B min(m, p - r); others by walking the schedule."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - rank)
    return _walk(plan(schedule, p, m, v).actions[rank], {c: 1 for c in range(v)})


def _walk(actions, per_chunk: dict[int, int]) -> int:
    """Peak of the bytes alive when each F adds its chunk's bytes and the action that ends the
    microbatch's backward (W if backward is split, else B) frees them."""
    frees = "W" if any(a.op == "W" for a in actions) else "B"
    alive = peak = 0
    for a in actions:
        if a.op == "F":
            alive += per_chunk[a.chunk]
            peak = max(peak, alive)
        elif a.op == frees:
            alive -= per_chunk[a.chunk]
    return peak


@lru_cache(maxsize=256)
def chunk_params(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[list[tuple[str, tuple]]]:
    """(name, shape) of the parameters of each of this pipeline rank's chunks, in the order the
    engines register them: the embedding on virtual stage 0, the final norm and head on the
    last, the blocks evenly in between. One list of every parameter when pp == 1."""
    shapes = param_shapes(model)
    if cfg.pp == 1:
        return [shapes]
    p, v = cfg.pp, cfg.virtual_stages
    out = []
    for c in range(v):
        s = stage_of(pp_rank, c, p)
        blocks = {str(i) for i in chunk_layers(model.layers, p, v, pp_rank, c)}
        out.append([(n, sh) for n, sh in shapes
                    if (n.startswith("embed.") and s == 0) or (n.startswith("head.") and s == p * v - 1)
                    or (n.startswith("blocks.") and n.split(".", 2)[1] in blocks)])
    return out


def rank_params(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Parameters held by one pipeline rank (all of its chunks)."""
    return sum(prod(s) for chunk in chunk_params(cfg, model, pp_rank) for _, s in chunk)


def microbatch_rows(cfg: ParallelConfig) -> int:
    """Sequences per microbatch on one rank: global_batch / (dp · ep · microbatches)."""
    return cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)


def activation_peak(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Peak bytes saved for backward on one pipeline rank: each chunk's per-microbatch
    activations times the microbatches in flight the schedule allows (theory/activations.py
    walks the schedule)."""
    from labkit.theory.activations import peak

    return peak(cfg, model, pp_rank)


def p2p_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Sends and receives of one step, per rank: for each microbatch and each of the rank's
    chunks, its output activation forward (unless it is the last stage) and its input's
    gradient backward (unless it is the first), each (b, s/cp, h) — s/(cp·tp) under SP — in the
    compute dtype."""
    if cfg.pp == 1:
        return
    p, v, m = cfg.pp, cfg.virtual_stages, cfg.microbatches
    rows = model.seq // cfg.cp // (cfg.tp if cfg.sequence_parallel else 1)
    nbytes = microbatch_rows(cfg) * rows * model.hidden * ELEM[cfg.precision]
    label = layout.label("pp")
    for rank in comm.ranks(layout):
        r = layout.coords(rank)["pp"]
        for c in range(v):
            s = stage_of(r, c, p)
            if s < p * v - 1:    # activation out, its gradient back in
                comm.add(rank, label, "send", nbytes, p, calls=m)
                comm.add(rank, label, "recv", nbytes, p, calls=m)
            if s > 0:            # activation in, its gradient back out
                comm.add(rank, label, "recv", nbytes, p, calls=m)
                comm.add(rank, label, "send", nbytes, p, calls=m)


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


def simulated(cfg: ParallelConfig, costs: dict | None = None, schedule: str | None = None):
    """The simulator's ideal timeline of `cfg`'s schedule (labkit/plans/simulator.py): unit
    costs by default, or measured ones (`costs_from_result(result)`). Pure; a Simulation."""
    from labkit.plans.simulator import Costs, simulate

    pl = plan(schedule or cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    return simulate(pl, Costs(**costs) if costs else Costs())
