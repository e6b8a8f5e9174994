"""What each pipeline rank holds, in closed form, for the planner's memory and time models (which
price thousands of layouts a second): its blocks, whether it holds the embedding and the head, and
the parameters one rank holds of a block and of the two ends after the tp and ep splits. The exact,
parameter-by-parameter version for labkit's engines is theory/exact/params.py; these counts agree with
it up to the flat buffers' padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.schedules import chunk_layers, stage_of
from labkit.theory.exact.experts import is_expert
from labkit.theory.exact.model import param_shapes
from labkit.theory.planner.ops import LATENT, ROWWISE, representative_block


@dataclass(frozen=True)
class Stage:
    """One pipeline rank (the whole model when pp == 1)."""

    rank: int
    layers: int
    """Blocks on this rank, over all its chunks."""
    chunks: int
    largest_chunk: int
    embed: bool
    head: bool
    dense_blocks: int = 0
    """Of its blocks, those with a dense MLP in an MoE model (ModelConfig.dense_layers; 0 otherwise)."""

    def __hash__(self) -> int:
        # once: the planner's memory caches key on a stage ~300,000 times a search (ints and bools only,
        # so the same in every process)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(
                (self.rank, self.layers, self.chunks, self.largest_chunk, self.embed, self.head, self.dense_blocks)
            )
            object.__setattr__(self, "_hash", h)
        return h


def _layers(cfg: ParallelConfig, model: ModelConfig, rank: int, chunk: int) -> int:
    return len(chunk_layers(model.layers, cfg.pp, cfg.virtual_stages, rank, chunk, cfg.stage_layers))


def stages(cfg: ParallelConfig, model: ModelConfig) -> tuple[Stage, ...]:
    """Every pipeline rank's Stage."""
    return _stages(model, cfg.pp, cfg.virtual_stages, cfg.stage_layers)


def fullest_candidates(cfg: ParallelConfig, model: ModelConfig) -> tuple[Stage, ...]:
    """The ranks one of which holds the most: the first two and the last two (the embedding, the
    head, the most microbatches in flight, which fall with the rank in every schedule here), and
    the first rank with the most blocks (uneven stages)."""
    return _candidates(model, cfg.pp, cfg.virtual_stages, cfg.stage_layers)


@lru_cache(maxsize=4096)
def _candidates(model: ModelConfig, p: int, v: int, uneven: tuple) -> tuple[Stage, ...]:
    every = _stages(model, p, v, uneven)
    most = max(every, key=lambda st: st.layers)
    # min and max fold the picks together when p < 4
    picked = {0, min(1, p - 1), max(p - 2, 0), p - 1, most.rank}
    return tuple(every[r] for r in sorted(picked))


def distinct(cfg: ParallelConfig, model: ModelConfig) -> tuple[Stage, ...]:
    """One rank of each kind (blocks, chunks, embedding, head): the ranks whose step differs."""
    return _distinct(model, cfg.pp, cfg.virtual_stages, cfg.stage_layers)


@lru_cache(maxsize=4096)
def _distinct(model: ModelConfig, p: int, v: int, uneven: tuple) -> tuple[Stage, ...]:
    seen: dict[tuple, Stage] = {}
    for st in _stages(model, p, v, uneven):
        # ranks alike in these four take the same time: the step's timing prices each kind once
        seen.setdefault((st.layers, st.chunks, st.embed, st.head), st)
    return tuple(seen.values())


@lru_cache(maxsize=4096)
def _stages(model: ModelConfig, p: int, v: int, uneven: tuple) -> tuple[Stage, ...]:
    dense = min(model.dense_layers, model.layers) if model.experts else 0
    if p == 1:
        return (Stage(0, model.layers, 1, model.layers, True, True, dense),)
    # a bare config only to place the chunks: Megatron's loop, stage c·p + r, whatever the schedule
    cfg = ParallelConfig(pp=p, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b")
    if uneven:
        cfg = cfg.replace(stage_layers=uneven)
    out = []
    for r in range(p):
        per = [_layers(cfg, model, r, c) for c in range(v)]
        ids = [stage_of(r, c, p) for c in range(v)]
        held = [i for c in range(v) for i in chunk_layers(model.layers, p, v, r, c, cfg.stage_layers)]
        out.append(Stage(r, sum(per), v, max(per), 0 in ids, p * v - 1 in ids, sum(i < dense for i in held)))
    return tuple(out)


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds of one block and of the two ends, after the tp and ep splits."""

    dense: int
    """Of a block: everything but the experts (gradients reduced over dp x ep x cp)."""
    expert: int
    """Of a block: its E/ep experts (reduced over dp x cp)."""
    embed: int
    head: int
    dense_block: int = 0
    """Of a dense block of an MoE model (its first dense_layers): all of it, split over tp."""


def _column_parallel(module: str) -> bool:
    return module.startswith(("attn.", "mlp.")) and module not in ROWWISE


@lru_cache(maxsize=1024)
def rank_params(model: ModelConfig, tp: int, ep: int) -> RankParams:
    """Matrices of a block split over tp (row- or column-wise), vectors whole, experts over ep
    (and whole over tp, layout/tensor.py), the token table and the LM head over tp."""
    dense = expert = embed = head = dense_block = 0
    first = representative_block(model)
    for name, shape in param_shapes(model):
        n = prod(shape)
        if first != "blocks.0." and name.startswith("blocks.0."):  # a dense block of an MoE model: all split
            # MLA's latent down-projections whole here too (layout/tensor.py 'latent')
            matrix = len(shape) == 2 and name[9 : -len(".weight")] not in LATENT
            split = matrix or (name.endswith(".bias") and _column_parallel(name[9 : -len(".bias")]))
            dense_block += n // tp if split else n
        # one block stands for every block: they are alike (the dense first ones apart)
        if name.startswith(first):
            if is_expert(name):
                expert += n // ep
            elif ".mlp.shared." in name:
                dense += n  # replicated over tp with the MoE layer
            # matrices split over tp, row- or column-wise alike; the router stays whole, as an MoE layer is
            # replicated over tp
            elif len(shape) == 2 and not name.endswith("router.weight"):
                # MLA's latent down-projections stay whole on every tp rank (layout/tensor.py 'latent')
                dense += n if name[len(first) : -len(".weight")] in LATENT else n // tp
            elif name.endswith("router.bias"):
                dense += n  # GPT-OSS's router bias: whole, as its router
            elif name.endswith(".bias") and _column_parallel(name[len(first) : -len(".bias")]):
                dense += n // tp  # split with its layer's rows
            elif name.endswith("attn.sinks"):
                dense += n // tp  # GPT-OSS: one per query head, split with wq's rows
            else:
                dense += n  # norms, a row-parallel layer's bias (added once), the router
        elif name.startswith("embed."):
            # the token table is vocab-parallel; a learned position table stays whole on every tp rank
            embed += n // tp if name.startswith("embed.tok") else n
        elif name.startswith("head."):
            # the projection is vocab-parallel; the final norm stays whole
            head += n // tp if name.startswith("head.proj") else n
    if model.tied:
        head += model.vocab // tp * model.hidden  # the head's copy when it sits on another stage
    return RankParams(dense, expert, embed, head, dense_block)


def stage_params(model: ModelConfig, cfg: ParallelConfig, st: Stage) -> tuple[int, int]:
    """(dense, expert) parameters of rank `st` (a tied head counted once when one rank holds both
    ends)."""
    rp = rank_params(model, cfg.tp, cfg.ep)
    ends = rp.embed * st.embed + rp.head * st.head
    # one rank holding both ends (pp = 1) keeps one tied table, not a copy for the head
    if model.tied and st.embed and st.head:
        ends -= model.vocab // cfg.tp * model.hidden
    moe = st.layers - st.dense_blocks  # the dense first blocks hold no experts
    return moe * rp.dense + st.dense_blocks * rp.dense_block + ends, moe * rp.expert
