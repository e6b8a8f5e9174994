"""Activations saved for backward on one rank, for any composed layout (pure Python).

Each strategy's module counts what its ops keep for one microbatch: memory.activation_bytes
(the plain model), tensor.activation_bytes (TP / SP), experts.layer_activation_bytes (an MoE
layer), with the sequence a rank holds s/cp (context.py). This module puts them together per
pipeline chunk and walks the schedule:

  chunk      its blocks, plus the embedding on virtual stage 0 and the head on the last;
             under TP an MoE layer is replicated over tp (plans/tensor.py), so it keeps what
             it keeps without TP, for all s/cp tokens of its sequence
  precision  activations in the compute dtype (LayerNorm statistics too, on the CPU); the
             attention log-sum-exp, the router probabilities and the loss's softmax in fp32
  recompute  (checkpoint_activations) a block keeps its input only, b·(s/cp)·h elements (s/tp
             rows under SP); in backward one block at a time is rebuilt, so a backward adds at
             most max(0, block - input - head) on top of what its forward left
  pipeline   forwards add their chunk's bytes, backwards free them, in the order the schedule
             runs them (GPipe keeps m microbatches, 1F1B at most p - r; Narayanan et al. 2021)
The peak of that walk is what the saved-tensor meter reports (exact for every layout the
tests run; an MoE layer under ep keeps R routed rows, routing dependent, here the balanced R).
One tensor is shared: under context parallelism the positions (this rank's zigzag indices,
8·s/cp bytes) are one tensor for every microbatch, so the first stage counts them once however
many microbatches are in flight (the meter counts storages).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.precision import ELEM
from labkit.plans.schedules import chunk_layers, plan, stage_of


def micro_rows(cfg: ParallelConfig) -> int:
    """Sequences per microbatch on one rank: global_batch / (dp · ep · microbatches)."""
    return cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)


def _bytes(cfg: ParallelConfig, model: ModelConfig, b: int, layers: int, head: bool, embed: bool) -> int:
    """What one microbatch of `b` sequences keeps in `layers` blocks (+ head / embedding), no recompute."""
    from labkit.theory import memory, tensor

    act = ELEM[cfg.precision]
    seq = model.seq // cfg.cp
    if cfg.tp == 1:
        return memory.activation_bytes(model.replace(seq=seq), b, layers=layers, head=head, embed=embed,
                                       act_bytes=act)
    return tensor.activation_bytes(model.replace(layers=layers), b, cfg.tp, cfg.sequence_parallel, seq, act,
                                   head=head, embed=embed)


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
    b = micro_rows(cfg)
    if not cfg.checkpoint_activations:
        return Chunk(_bytes(cfg, model, b, layers, head, embed))
    rows = model.seq // cfg.cp // (cfg.tp if cfg.sequence_parallel else 1)
    x = ELEM[cfg.precision] * b * rows * model.hidden            # a block's input, all it keeps
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
    from labkit.theory.experts import layer_activation_bytes

    b, act = micro_rows(cfg), ELEM[cfg.precision]
    seq = model.seq // cfg.cp
    delta = [layer_activation_bytes(model, b, seq, act, received=r) - layer_activation_bytes(model, b, seq, act)
             for r in received]
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
        layers = len(chunk_layers(model.layers, p, v, pp_rank, c))
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

    if cfg.pp == 1:   # accumulation: each microbatch's graph is freed before the next forward
        return max(per(mb, 0).forward + per(mb, 0).backward_extra for mb in range(cfg.microbatches))
    v = cfg.virtual_stages
    first = [c for c in range(v) if stage_of(pp_rank, c, cfg.pp) == 0]
    shared = 8 * (model.seq // cfg.cp) if cfg.cp > 1 and first else 0    # the zigzag positions (docstring)
    actions = plan(cfg.schedule, cfg.pp, cfg.microbatches, v).actions[pp_rank]
    frees = "W" if any(a.op == "W" for a in actions) else "B"
    alive = top = embedded = 0        # embedded: microbatches whose embedding is in flight
    for a in actions:
        if a.op not in ("F", "B", frees):
            continue
        c = per(a.mb, a.chunk)
        kept = c.forward - (shared if a.chunk in first else 0)
        if a.op == "F":
            alive += kept
            embedded += a.chunk in first
            top = max(top, alive + (shared if embedded else 0))
        elif a.op == "B":
            top = max(top, alive + (shared if embedded else 0) + c.backward_extra)
        if a.op == frees:
            alive -= kept
            embedded -= a.chunk in first
    return top
