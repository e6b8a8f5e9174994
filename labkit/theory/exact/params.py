"""The parameters one rank holds, as the engines lay them out: each strategy contributes its
rule, in the order engines/parallelize.py applies the strategies.

    pipeline (pp)   which chunks and layers the rank keeps     theory/exact/pipeline.py chunk_full_shapes
    experts (ep)    E/ep experts of every MoE layer            theory/exact/experts.py local_shapes
    tensor (tp)     the styles' slice of each matrix           labkit/layout/tensor.py local_param

One rank's share, parameter by parameter as the engines hold it: the whole model (Ψ) is
theory/exact/model.py's `num_params`, a pipeline rank's before the ep and tp splits
theory/exact/pipeline.py's `full_param_count`, and the planner's closed form per block
theory/planner/stages.py's `rank_params`.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.tensor import local_param, tp_styles
from labkit.theory.exact import experts
from labkit.theory.exact.pipeline import chunk_full_shapes


@lru_cache(maxsize=4096)
def chunk_local_params(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> tuple[tuple[tuple, ...], ...]:
    """Per pipeline chunk of rank `pp_rank`: (name, local shape, dims its gradient is summed over)
    of each parameter, in registration order — the chunk's full shapes after the ep and tp
    splits. Every rank at one pipeline coordinate holds the same shapes (the splits are even),
    so an estimate at scale computes this once per coordinate."""
    styles = tp_styles(model, cfg.sequence_parallel, cfg.tp) if cfg.tp > 1 else None
    out = []
    for chunk in chunk_full_shapes(cfg, model, pp_rank):
        rows = []
        for name, shape in experts.local_shapes(cfg, model, chunk):
            dims = experts.reduce_dims(name, cfg)
            if styles is not None:
                shape, _, extra, _ = local_param(styles, name, shape, cfg.tp)
                dims = dims + extra
            rows.append((name, tuple(shape), dims))
        out.append(tuple(rows))
    return tuple(out)


@lru_cache(maxsize=256)
def rank_param_count(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """Parameters one rank at pipeline coordinate `pp_rank` holds, after every split."""
    return sum(prod(s) for chunk in chunk_local_params(cfg, model, pp_rank) for _, s, _ in chunk)


def rank_entries(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[tuple[str, tuple, tuple, int]]:
    """(name, local shape, reduce dims, pipeline chunk) of every parameter a rank holds: what
    the flat-buffer layouts of ZeRO / FSDP take (labkit/layout/flat.py)."""
    return [(n, s, d, c) for c, chunk in enumerate(chunk_local_params(cfg, model, pp_rank)) for n, s, d in chunk]
