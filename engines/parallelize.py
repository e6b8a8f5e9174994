"""parallelize(model, mesh, cfg): apply every strategy of a layout, in one fixed order.

The order is the one torchtitan documents (parallelize_llama): strategies that change what a
module computes come first, those that decide where its pieces live and how its gradients
are reduced come last, because they wrap whatever the earlier ones left.

  1. tensor parallelism (+ sequence parallelism)   swaps Linear / Embedding / loss   [tp]
  2. context parallelism                            swaps the attention kernel        [cp]
  3. expert parallelism                             keeps E/ep experts, all-to-all    [ep]
  4. activation checkpointing                       recomputes blocks in backward
  5. pipeline parallelism                           keeps this stage's chunks         [pp]
  6. data parallelism: DDP / ZeRO / FSDP            reduces gradients, owns the update [dp]

Steps 1-5 are added by their own modules as they are built; until then `unsupported` names
the layouts that cannot run yet, and labkit.config refuses them before any engine work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.engines.mesh import Mesh
from labkit.engines.parallel.common import GradSync


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


def data_parallel_dims(cfg: ParallelConfig) -> tuple[str, ...]:
    """Dims over which dense gradients are reduced: every dim whose ranks see different tokens."""
    return ("dp", "ep", "cp")


def parallelize(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, optim: OptimConfig, meters) -> Parallel:
    from labkit.engines.schedules import accumulate

    device = meters.device
    model = model.to(device)
    loss_shards = mesh.size(*data_parallel_dims(cfg))
    group = mesh.group(*data_parallel_dims(cfg))

    # 6. data parallelism
    if cfg.impl == "torch":
        from labkit.engines.parallel.ddp import TorchDDP

        sync = TorchDDP(model, group, cfg.bucket_mb, optim)
        chunks = [sync.module]
    else:
        from labkit.engines.parallel.ddp import DDP

        sync = DDP(list(model.named_parameters()), group, loss_shards,
                   int(cfg.bucket_mb * 2**20), optim)
        chunks = [model]
    return Parallel(chunks=chunks, grads=sync, schedule=accumulate)
