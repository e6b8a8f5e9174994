"""parallelize(model, mesh, cfg): apply every strategy of a layout, in one fixed order.

The order is the one torchtitan documents (parallelize_llama): strategies that change what a
module computes come first, those that decide where its pieces live and how its gradients
are reduced come last, because they wrap whatever the earlier ones left.

  0. float8 (precision='fp8')                       swaps the blocks' Linear for fp8 ones
  1. tensor parallelism (+ sequence parallelism)   swaps Linear / Embedding / loss   [tp]
  2. context parallelism                            swaps the attention kernel        [cp]
  3. expert parallelism                             keeps E/ep experts, all-to-all    [ep]
  3b. compiled blocks (ParallelConfig.compile)      each block's forward, torch.compile
  4. activation checkpointing                       recomputes blocks in backward
  5. pipeline parallelism                           keeps this stage's chunks         [pp]
  6. precision                                      bf16 compute, fp32 masters (a policy)
     (0 comes first as torchtitan converts at model build: TP then slices fp8 layers, and they and
     FSDP share the weights' per-step scales, `WeightScales`)
  7. data parallelism: DDP / ZeRO / FSDP            reduces gradients, owns the update [dp]

A strategy gets what it uses, never the ParallelConfig: the model, the mesh whose groups it
reads (or the DeviceMesh it runs on, or the meter it feeds), and named values — torchtitan's
apply_tp(model, tp_mesh, loss_parallel=...). This function is the one place that reads the
config. Two return shapes:
  - a strategy that changes modules (1-5): apply_<x>(model, mesh, *, values) -> (model, info):
    what runs next (after the pipeline: this rank's chunks), and plain data for the report
    ({} when there is nothing to say);
  - the data-parallel step (7), apply_zero / apply_fsdp(_torch) or a GradSync class built
    directly (DDP, TorchDDP, TorchTP, TorchStageGrads), returns a GradSync
    (engines/parallel/common.py) whose `modules` are what runs forward (PyTorch's DDP wraps them).
The step's schedule and the input map are chosen here from the layout, beside the strategy they
belong to: gradient accumulation or a pipeline schedule (DTensor's loss_parallel around it),
and context parallelism's zigzag slice of the inputs.

They compose through the parameters' metadata (engines/parallel/common.py: a ParamMeta per
parameter, in the one ParamMetas this function makes and hands to each), not by knowing each
other: TP slices and marks replicas and SP's extra reduce dim; EP slices the experts, which it
reduces over dp-cp, and keeps TP's marks (MoE layers are replicated over tp); the
pipeline keeps this stage's chunks under their full names; the data-parallel step reduces each
gradient over its own group, buckets or shards per group and chunk, and counts each parameter
once in the global norm. labkit.config refuses, with the reason, the few combinations that are
not built or that frameworks reject (GUIDE.md, "Composition").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from labkit.config import OptimConfig, ParallelConfig
from labkit.engines.accumulate import accumulate
from labkit.engines.float8 import WeightScales, convert, convert_torchao
from labkit.engines.mesh import Mesh
from labkit.engines.parallel.checkpoint import apply_ac
from labkit.engines.parallel.common import GradSync, ParamMetas, on_device
from labkit.engines.parallel.compile import apply_compile
from labkit.engines.parallel.context import zigzag_inputs
from labkit.engines.parallel.context.kinds import apply_cp
from labkit.engines.parallel.ddp import DDP, TorchDDP
from labkit.engines.parallel.experts import apply_ep
from labkit.engines.parallel.fsdp import apply_fsdp, apply_fsdp_torch
from labkit.engines.parallel.pipeline import apply_pipeline, pipeline_executor
from labkit.engines.parallel.pipeline.pipelining import TorchSchedule, TorchStageGrads
from labkit.engines.parallel.tensor import apply_tp
from labkit.engines.parallel.zero import apply_zero
from labkit.engines.precision import policy
from labkit.layout.mesh import DATA_DIMS


def whole_sequence(tokens: torch.Tensor, targets: torch.Tensor):
    """The input map without context parallelism: every position (chunk 0 numbers them itself)."""
    return tokens, targets, None


@dataclass
class RankModel:
    """This rank's share of the model, and what trains it: what parallelize returns."""

    chunks: list[nn.Module]
    """This rank's model: one module per pipeline chunk (a single one when pp == 1)."""
    grads: GradSync
    """Gradient reduction, clipping and the optimizer update."""
    schedule: Callable
    """schedule(rank_model, microbatches, meters) -> this rank's share of the loss (see train.py)."""
    inputs: Callable = whole_sequence
    """Map a rank's (tokens, targets) to what chunk 0 takes (context parallelism slices the sequence)."""
    info: dict = field(default_factory=dict)
    """Plain data about the layout for the report (TP styles, pipeline stages, ...)."""


def parallelize(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, optim: OptimConfig, meters) -> RankModel:
    """Apply every strategy of `cfg` to the full, seeded `model`; return this rank's share."""
    model = on_device(model, meters.device)
    schedule, inputs, info = accumulate, whole_sequence, {}
    metas = ParamMetas()  # what 1, 3 and 5 say of the parameters they change, for 7

    # 0. float8: engines/float8.py; PyTorch's strategies run torchao's own layers (FSDP2's fp8 all-gather)
    float8 = None
    if cfg.numerics.fp8 and cfg.torch_impl:
        info["float8"] = convert_torchao(model, cfg.fp8_recipe, fsdp_all_gather=cfg.fp8_scaling.gathers_fp8)
    elif cfg.numerics.fp8:
        info["float8"] = convert(model, cfg.fp8_recipe)
        # the scales of weights a strategy splits (TP's slices, FSDP's shards): tensorwise only
        float8 = None if cfg.fp8_scaling.rowwise else WeightScales()

    # 1. tensor parallelism (+ sequence parallelism): engines/parallel/tensor/, or DTensor's
    if cfg.tp > 1 and cfg.torch_impl:
        # DTensor's package holds ~45 MB per process: only runs with impl='torch' load it
        from labkit.engines.parallel.tensor.dtensor import apply_tp_torch, in_loss_parallel, tp_device_mesh

        tp_mesh = tp_device_mesh(mesh, meters.device.type, with_fsdp=cfg.sharded.fsdp)
        tensorwise = cfg.numerics.fp8 and cfg.fp8_scaling.gathers_fp8  # torchao's float8 TP styles
        model, info["tp_styles"] = apply_tp_torch(
            model, tp_mesh, sequence_parallel=cfg.sequence_parallel, fp8=tensorwise
        )
        schedule = in_loss_parallel(schedule)
    elif cfg.tp > 1:
        model, info["tp_styles"] = apply_tp(model, mesh, metas, sequence_parallel=cfg.sequence_parallel, float8=float8)

    # 2. context parallelism: engines/parallel/context/ (the ring), context/kinds.py (all-gather, Ulysses)
    if cfg.cp > 1:
        model, info["cp"] = apply_cp(model, mesh, cfg.context, cfg.cp_a2a)
        inputs = zigzag_inputs(model.cfg.seq, mesh)

    # 3. expert parallelism: engines/parallel/experts.py
    if cfg.ep > 1:
        model, info["ep"] = apply_ep(model, mesh, metas)

    # 3b. compiled blocks: engines/parallel/compile.py (after 1-3 swapped their layers in, before 4 wraps them)
    if cfg.compile:
        model, info["compile"] = apply_compile(model)

    # 4. activation checkpointing: engines/parallel/checkpoint.py
    if cfg.recomputation.recomputes:
        model, _ = apply_ac(model, meters.memory, selective=cfg.recomputation.attention_only)  # nothing to report

    # 5. pipeline parallelism: engines/parallel/pipeline/; its schedule ours, or torch.distributed.pipelining's
    chunks = [model]
    if mesh.size("pp") > 1:
        chunks, stages = apply_pipeline(
            model, mesh, metas, virtual_stages=cfg.virtual_stages, stage_layers=cfg.stage_layers, schedule=cfg.schedule
        )
        info["pipeline"] = {"schedule": cfg.schedule, **stages}
        if cfg.torch_impl:
            schedule = TorchSchedule(
                mesh, schedule=cfg.schedule, microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages
            )
        else:
            schedule = pipeline_executor(
                mesh,
                schedule=cfg.schedule,
                microbatches=cfg.microbatches,
                virtual_stages=cfg.virtual_stages,
                hidden=model.cfg.hidden,
                dtype=policy(cfg.precision).compute,  # stages pass the compute dtype
                seq_split=mesh.size("tp") if cfg.sequence_parallel else 1,
            )  # SP: s/tp rows
            info["pipeline"]["actions"] = [str(a) for a in schedule.actions]

    # 6. precision: engines/precision.py (the data-parallel strategy casts to it and keeps the masters)
    pol = policy(cfg.precision)
    fp8_gather = cfg.numerics.fp8 and cfg.fp8_scaling.gathers_fp8  # FSDP's float8 all-gather

    # 7. data parallelism: DDP (ddp.py), ZeRO (zero.py), FSDP (fsdp.py); PyTorch's own with impl='torch'
    loss_shards = mesh.size(*DATA_DIMS)
    bucket_bytes = int(cfg.bucket_mb * 2**20)
    if cfg.sharded.fsdp and cfg.torch_impl:
        sync = apply_fsdp_torch(
            chunks[0], mesh, reshard=cfg.reshard_after_forward, pol=pol, optim=optim, meters=meters, float8=fp8_gather
        )
    elif cfg.sharded.fsdp:
        sync = apply_fsdp(
            chunks,
            mesh,
            metas,
            reshard=cfg.reshard_after_forward,
            pol=pol,
            optim=optim,
            meters=meters,
            loss_shards=loss_shards,
            float8=float8,
        )
    elif cfg.sharded.stage:  # ZeRO-1, 2 or 3
        sync = apply_zero(
            chunks,
            mesh,
            metas,
            stage=cfg.sharded.stage,
            bucket_bytes=bucket_bytes,
            pol=pol,
            optim=optim,
            meters=meters,
            loss_shards=loss_shards,
            float8=float8,
        )
    elif cfg.torch_impl and mesh.size("pp") > 1:
        sync = TorchStageGrads(chunks, mesh, metas, cfg.bucket_mb, optim)  # PyTorch's DDP per stage chunk
    elif cfg.torch_impl and cfg.tp > 1:
        from labkit.engines.parallel.tensor.dtensor import TorchTP  # DTensor: only its runs load it

        sync = TorchTP(chunks[0], mesh, optim)  # no dp: labkit.config refuses DDP with DTensor TP
    elif cfg.torch_impl:
        sync = TorchDDP(chunks[0], mesh.group(*DATA_DIMS), metas, cfg.bucket_mb, optim)
    else:
        sync = DDP(
            chunks,
            mesh,
            metas,
            loss_shards=loss_shards,
            bucket_bytes=bucket_bytes,
            optim=optim,
            pol=pol,
            meters=meters,
        )
    if hasattr(sync, "layouts"):  # ours: the flat buffers, for the report
        info["flat_buffers"] = [
            {"unit": p.unit, "numel": p.numel, "padded": p.padded, "shard": p.shard} for p in sync.layouts
        ]
    return RankModel(chunks=sync.modules, grads=sync, schedule=schedule, inputs=inputs, info=info)
