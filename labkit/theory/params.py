"""The parameters one rank holds, as the engines lay them out: each strategy's theory module
contributes its rule, in the order engines/parallelize.py applies the strategies.

    pipeline (pp)   which chunks and layers the rank keeps     theory/pipeline.py chunk_params
    experts (ep)    E/ep experts of every MoE layer            theory/experts.py local_shapes
    tensor (tp)     the plan's slice of each matrix            engines/parallel/tensor_plan.py
"""
from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig


@lru_cache(maxsize=256)
def chunk_params(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[list[tuple[str, tuple, tuple]]]:
    """Per pipeline chunk of rank `pp_rank`: (name, local shape, dims its gradient is summed over)
    of each parameter, in registration order."""
    from labkit.engines.parallel.tensor_plan import local_param, tp_plan
    from labkit.theory import experts, pipeline

    plan = tp_plan(model, cfg.sequence_parallel) if cfg.tp > 1 else None
    out = []
    for chunk in pipeline.chunk_params(cfg, model, pp_rank):
        rows = []
        for name, shape in experts.local_shapes(cfg, model, chunk):
            dims = experts.reduce_dims(name, cfg)
            if plan is not None:
                shape, _, extra, _ = local_param(plan, name, shape, cfg.tp)
                dims = dims + extra
            rows.append((name, tuple(shape), dims))
        out.append(rows)
    return tuple(tuple(rows) for rows in out)


@lru_cache(maxsize=256)
def rank_param_count(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    return sum(prod(s) for chunk in chunk_params(cfg, model, pp_rank) for _, s, _ in chunk)
