"""Activations saved for backward on one rank, for any composed layout: each strategy's
module counts what its ops keep for one microbatch (memory.py the plain model, tensor.py TP /
SP, experts.py an MoE layer, with s/cp positions under CP); this module adds them up per
pipeline chunk, with recomputation, and walks the schedule (pipeline.peak_in_flight). The peak
of that walk is what the saved-tensor meter reports; the rules of the walk: ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.precision import ELEM
from labkit.plans.schedules import chunk_layers, plan, stage_of
from labkit.theory import memory, tensor
from labkit.theory.batch import microbatch_rows, stream_rows
from labkit.theory.experts import layer_activation_bytes
from labkit.theory.pipeline import peak_in_flight


def _bytes(cfg: ParallelConfig, model: ModelConfig, b: int, layers: int, head: bool, embed: bool) -> int:
    """What one microbatch of `b` sequences keeps in `layers` blocks (+ head / embedding), no recompute."""
    act = ELEM[cfg.precision]
    seq = model.seq // cfg.cp
    if cfg.tp == 1:
        return memory.activation_bytes(model.replace(seq=seq), b, layers=layers, head=head, embed=embed, act_bytes=act)
    return tensor.activation_bytes(
        model.replace(layers=layers), b, cfg.tp, cfg.sequence_parallel, seq, act, head=head, embed=embed
    )


@dataclass(frozen=True)
class Chunk:
    """Bytes one microbatch leaves saved after a chunk's forward, and what its backward adds on
    top; `block`, `x` and `head` are the parts the routed variant recomputes."""

    forward: int
    backward_extra: int = 0
    block: int = 0
    x: int = 0
    head: int = 0


def chunk(cfg: ParallelConfig, model: ModelConfig, layers: int, head: bool, embed: bool) -> Chunk:
    """One pipeline chunk (or the whole model when pp == 1) for one microbatch."""
    b = microbatch_rows(cfg)
    if not cfg.checkpoint_activations:
        return Chunk(_bytes(cfg, model, b, layers, head, embed))
    x = ELEM[cfg.precision] * b * stream_rows(cfg, model) * model.hidden  # a block's input, all it keeps
    block = _bytes(cfg, model, b, 1, False, False)
    head_bytes = _bytes(cfg, model, b, 0, True, False) if head else 0
    kept = _bytes(cfg, model, b, 0, False, True) if embed else 0
    extra = max(0, block - x - head_bytes) if layers else 0
    return Chunk(kept + layers * x + head_bytes, extra, block, x, head_bytes)


def routed(cfg: ParallelConfig, model: ModelConfig, c: Chunk, received: list[int]) -> Chunk:
    """Chunk `c` for a microbatch whose MoE layers' experts received `received[l]` rows each
    (routing dependent under ep; `c` assumes the balanced R = N): every layer's R rows kept; or,
    recomputed, block l rebuilt while the inputs of blocks 0..l are still kept (later ones were
    freed by their backward): the backward adds max_l(block_l + l·x) - L·x - head."""
    b, act = microbatch_rows(cfg), ELEM[cfg.precision]
    seq = model.seq // cfg.cp
    delta = [
        layer_activation_bytes(model, b, seq, act, received=r) - layer_activation_bytes(model, b, seq, act)
        for r in received
    ]
    if not cfg.checkpoint_activations:
        return Chunk(c.forward + sum(delta))
    rebuilt = max((c.block + d + l * c.x for l, d in enumerate(delta)), default=0)
    return Chunk(c.forward, max(0, rebuilt - len(delta) * c.x - c.head) if delta else 0, c.block, c.x, c.head)


def chunks(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> dict[int, Chunk]:
    """Each of pipeline rank `pp_rank`'s chunks (chunk 0: the whole model when pp == 1)."""
    p, v = cfg.pp, cfg.virtual_stages if cfg.pp > 1 else 1
    out = {}
    for c in range(v):
        s = stage_of(pp_rank, c, p)
        layers = len(chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers))
        out[c] = chunk(cfg, model, layers, head=s == p * v - 1, embed=s == 0)
    return out


def peak(cfg: ParallelConfig, model: ModelConfig, pp_rank: int = 0, received: dict | None = None) -> int:
    """Peak bytes saved for backward on a rank at pipeline coordinate `pp_rank` over one step.
    received: {(microbatch, chunk): [R of each MoE layer of the chunk]}, rows each layer's experts
    got (routing dependent under ep; read off a run's combine all-to-alls) for the exact value;
    default the balanced R = N."""
    if received is None:
        return _peak(cfg, model, pp_rank)
    return _walk(cfg, model, pp_rank, received)


@lru_cache(maxsize=4096)
def _peak(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    return _walk(cfg, model, pp_rank, None)


def _walk(cfg: ParallelConfig, model: ModelConfig, pp_rank: int, received: dict | None) -> int:
    base = chunks(cfg, model, pp_rank)

    def per(mb: int, c: int) -> Chunk:
        return base[c] if received is None else routed(cfg, model, base[c], received[mb, c])

    if cfg.pp == 1:  # accumulation: each microbatch's graph is freed before the next forward
        return max(per(mb, 0).forward + per(mb, 0).backward_extra for mb in range(cfg.microbatches))
    v = cfg.virtual_stages
    first = tuple(c for c in range(v) if stage_of(pp_rank, c, cfg.pp) == 0)
    # under CP the first stage's positions (this rank's zigzag indices, 8·s/cp bytes) are one
    # tensor for every microbatch: counted once however many are in flight (the meter counts storages)
    # (llama has no position table: nothing keeps them)
    shared = 8 * (model.seq // cfg.cp) if cfg.cp > 1 and first and model.arch != "llama" else 0
    actions = plan(cfg.schedule, cfg.pp, cfg.microbatches, v).actions[pp_rank]
    return peak_in_flight(
        actions,
        kept=lambda mb, c: per(mb, c).forward - (shared if c in first else 0),
        extra=lambda mb, c: per(mb, c).backward_extra,
        shared=shared,
        first=first,
    )
