"""parallelize(model, mesh, cfg): apply every strategy of a layout, in one fixed order.

The order is the one torchtitan documents (parallelize_llama): strategies that change what a
module computes come first, those that decide where its pieces live and how its gradients
are reduced come last, because they wrap whatever the earlier ones left.

  1. tensor parallelism (+ sequence parallelism)   swaps Linear / Embedding / loss   [tp]
  2. context parallelism                            swaps the attention kernel        [cp]
  3. expert parallelism                             keeps E/ep experts, all-to-all    [ep]
  4. activation checkpointing                       recomputes blocks in backward
  5. pipeline parallelism                           keeps this stage's chunks         [pp]
  6. precision                                      bf16 compute, fp32 masters (a policy)
  7. data parallelism: DDP / ZeRO / FSDP            reduces gradients, owns the update [dp]

They compose through the parameters' metadata (engines/parallel/common.py), not by knowing
each other: TP slices and marks replicas and SP's extra reduce dim; EP slices the experts,
which it reduces over dp-cp, and keeps TP's marks (MoE layers are replicated over tp); the
pipeline keeps this stage's chunks under their full names; the data-parallel step reduces each
gradient over its own group, buckets or shards per group and chunk, and counts each parameter
once in the global norm. labkit.config refuses, with the reason, the few combinations that are
not built or that frameworks reject (README.md, "Composition").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from labkit.config import OptimConfig, ParallelConfig
from labkit.engines.mesh import Mesh
from labkit.engines.parallel.common import GradSync, on_device
from labkit.plans.mesh import DATA_DIMS


@dataclass
class Parallel:
    """This rank's share of the training."""

    chunks: list[nn.Module]
    """This rank's model: one module per pipeline chunk (a single one when pp == 1)."""
    grads: GradSync
    """Gradient reduction, clipping and the optimizer update."""
    schedule: Callable
    """schedule(parallel, microbatches, meters) -> this rank's share of the loss (see train.py)."""
    inputs: Callable = field(default=lambda tokens, targets: (tokens, targets, None))
    """Map a rank's (tokens, targets) to what chunk 0 takes (context parallelism slices the sequence)."""
    info: dict = field(default_factory=dict)
    """Plain data about the layout for the report (TP plan, pipeline stages, ...)."""


def parallelize(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, optim: OptimConfig, meters) -> Parallel:
    """Apply every strategy of `cfg` to the full, seeded `model`; return this rank's share."""
    from labkit.engines.schedules import accumulate

    model = on_device(model, meters.device)
    inputs = Parallel.inputs
    schedule = accumulate
    info: dict = {}

    # 1. tensor parallelism (+ sequence parallelism): engines/parallel/tensor.py, or DTensor's
    if cfg.tp > 1 and cfg.impl == "torch":
        from labkit.engines.parallel.tensor_torch import apply_tp_torch

        model, info["tp_plan"], schedule = apply_tp_torch(model, mesh, cfg, schedule)
    elif cfg.tp > 1:
        from labkit.engines.parallel.tensor import apply_tp

        model, info["tp_plan"] = apply_tp(model, mesh, cfg)

    # 2. context parallelism: engines/parallel/context.py
    if cfg.cp > 1:
        from labkit.engines.parallel.context import apply_cp

        inputs, info["cp"] = apply_cp(model, mesh, cfg)

    # 3. expert parallelism: engines/parallel/experts.py
    if cfg.ep > 1:
        from labkit.engines.parallel.experts import apply_ep

        info["ep"] = apply_ep(model, mesh, cfg)

    # 4. activation checkpointing: engines/parallel/checkpoint.py
    if cfg.checkpoint_activations:
        from labkit.engines.parallel.checkpoint import apply_ac

        apply_ac(model, meters)

    # 5. pipeline parallelism: engines/parallel/pipeline.py
    chunks = [model]
    if mesh.size("pp") > 1:
        from labkit.engines.parallel.pipeline import apply_pipeline

        chunks, schedule, info["pipeline"] = apply_pipeline(model, mesh, cfg, meters)

    # 6. precision: engines/precision.py (the data-parallel strategy casts to it and keeps the masters)
    from labkit.engines.precision import policy

    pol = policy(cfg.precision)

    # 7. data parallelism: DDP (ddp.py), ZeRO (zero.py), FSDP (fsdp.py)
    loss_shards = mesh.size(*DATA_DIMS)
    if cfg.sharding == "fsdp":
        from labkit.engines.parallel.fsdp import apply_fsdp

        sync = apply_fsdp(chunks[0], mesh, cfg, pol, optim, meters, loss_shards)
        chunks = [sync.module]
    elif cfg.sharding != "none":
        from labkit.engines.parallel.zero import apply_zero

        sync = apply_zero(chunks, mesh, cfg, pol, optim, meters, loss_shards)
    elif cfg.impl == "torch" and mesh.size("pp") > 1:
        from labkit.engines.parallel.pipeline_torch import TorchStageGrads   # DDP per stage chunk

        sync = TorchStageGrads(chunks, mesh, cfg.bucket_mb, optim)
        chunks = sync.modules
    elif cfg.impl == "torch" and cfg.tp > 1:
        from labkit.engines.parallel.tensor_torch import TorchTP

        sync = TorchTP(chunks[0], mesh, optim)
    elif cfg.impl == "torch":
        from labkit.engines.parallel.ddp import TorchDDP

        sync = TorchDDP(chunks[0], mesh.group(*DATA_DIMS), cfg.bucket_mb, optim)
        chunks = [sync.module]
    else:
        from labkit.engines.parallel.ddp import DDP

        params = [(n, p) for c in chunks for n, p in c.named_parameters()]
        sync = DDP(params, mesh, loss_shards, int(cfg.bucket_mb * 2**20), optim, pol, meters)
    if hasattr(sync, "plans"):   # ours: the flat buffers, for the report
        info["flat_buffers"] = [{"unit": p.unit, "numel": p.numel, "padded": p.padded, "shard": p.shard}
                                for p in sync.plans]
    return Parallel(chunks=chunks, grads=sync, schedule=schedule, inputs=inputs, info=info)
