"""The same tensor (+ sequence) parallelism through PyTorch's DTensor, as a user would write it.

`parallelize_module` with ColwiseParallel / RowwiseParallel / PrepareModuleInput (and
SequenceParallel under SP), each style derived from labkit's styles (layout/tensor.py), on a
one-dimensional DeviceMesh wrapped around the Mesh's tp group (`DeviceMesh.from_group`: no new
process group). torch.optim.AdamW and torch.nn.utils.clip_grad_norm_ do the update.

Choices, all of which run on gloo (torch 2.13):
- Biases (gpt2, Qwen2) and SwiGLU's three matrices are DTensor's own Colwise / Rowwise handling;
  a tied head is re-tied to the embedding's DTensor after parallelize_module (both Shard(0)).
  KV heads are split over tp only (tp <= kv_heads, as torchtitan requires).
- Embedding: RowwiseParallel on the token table (vocab-parallel: DTensor masks the tokens other
  ranks own and all-reduces the partial lookups). Under SP the embedding's sum stays
  replicated and PrepareModuleOutput slices it to s/t rows (no communication; an all-gather
  backward), because the learned position embedding is added to the full sequence first.
- LM head: ColwiseParallel with Shard(-1) logits and `loss_parallel()`, PyTorch's
  vocab-parallel cross-entropy; it must be active in forward and backward, so the schedule
  runs inside it.
- Parameters outside the styles (LayerNorms without SP, the position embedding) become
  Replicate DTensors with `distribute_module`, so clip_grad_norm_ sees DTensors only (it
  refuses a mix of DTensors and plain tensors).
- 2-D with FSDP2 (sharding='fsdp'), torchtitan's parallelize_llama order: TP first, on the tp
  slice of one (dp, tp) DeviceMesh built from the Mesh's own groups (`Mesh.device_mesh_2d`), then
  fully_shard on its dp slice (engines/parallel/fsdp.py); FSDP2 insists that both slices share
  one parent mesh. DDP over dp is not composed with DTensor TP (PyTorch composes TP with FSDP2;
  its DDP + TP path is a private transform): labkit.config refuses that, and TP with pp, cp, ep.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from labkit.config import OptimConfig
from labkit.engines.float8 import torchao_float8
from labkit.engines.meters.memory import local, unique_bytes
from labkit.engines.optim import torch_adamw
from labkit.engines.parallel.common import piece
from labkit.layout.tensor import shard_box, tp_styles


def torch_styles(styles: dict[str, dict], sequence_parallel: bool) -> dict:
    """labkit's styles in DTensor's ParallelStyles (modules outside them are replicated); under fp8
    the layers the styles mark fp8 take torchao's float8 styles, as torchtitan's float8 TP plan does
    (Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput: their operands cast on
    DTensors, whose amax is the whole tensor's, and SP's inputs gathered in fp8)."""
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream (b, s, h)
    f8 = torchao_float8().tp if any(s.get("fp8") for s in styles.values()) else None  # torchao: fp8 runs only
    colwise = lambda s: f8.Float8ColwiseParallel() if s.get("fp8") else ColwiseParallel()
    rowwise = lambda s: (f8.Float8RowwiseParallel if s.get("fp8") else RowwiseParallel)(output_layouts=between)
    out = {}
    for name, style in styles.items():
        kind = style["style"]
        prepare = f8.PrepareFloat8ModuleInput if style.get("input") == "all-gather-fp8" else PrepareModuleInput
        if kind == "colwise":
            out[name] = colwise(style)
        elif kind == "rowwise":
            out[name] = rowwise(style)
        elif kind == "input" and name.endswith("attn"):  # attention also takes the rotary tables (or None)
            out[name] = prepare(input_layouts=(between, None), desired_input_layouts=(Replicate(), None))
        elif kind == "input":
            out[name] = prepare(input_layouts=(between,), desired_input_layouts=(Replicate(),))
        elif kind == "sequence" and not name.endswith("pos"):
            out[name] = SequenceParallel()
        elif kind == "vocab" and name == "head.proj":
            out[name] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
        elif kind == "vocab":
            out[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if sequence_parallel:
                out[name.rpartition(".")[0]] = PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Shard(1)
                )
    return out


def _replicate_rest(model: nn.Module, tp_mesh) -> None:
    """Every module whose own parameters are still plain tensors: Replicate DTensor parameters,
    local tensors in and out."""

    def to_dtensor(_mod, inputs, mesh):
        return tuple(
            x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
        )

    def to_local(_mod, out, _mesh):
        return out.to_local() if isinstance(out, DTensor) else out

    for _, mod in list(model.named_modules()):
        own = list(mod.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(mod, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def tp_device_mesh(mesh, device_type: str, *, with_fsdp: bool) -> DeviceMesh:
    """The DeviceMesh DTensor TP runs on: the tp slice of the 2-D (dp, tp) mesh when FSDP2 shards over
    dp as well (FSDP2 insists both slices share one parent), else one dimension around the tp group."""
    if with_fsdp and mesh.size("dp") > 1:
        return mesh.device_mesh_2d(device_type)["tp"]
    return DeviceMesh.from_group(mesh.group("tp"), device_type)


def apply_tp_torch(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, fp8: bool = False
) -> tuple[nn.Module, dict]:
    """parallelize_module on `tp_mesh`; returns (model, the styles as data for the report). Its loss is
    vocab-parallel: run the step's schedule inside `in_loss_parallel`. `fp8`: the model's layers are
    torchao's Float8Linear (tensorwise), parallelized with its float8 styles."""
    styles = tp_styles(model.cfg, sequence_parallel, tp_mesh.size(), fp8=fp8)
    parallelize_module(model, tp_mesh, torch_styles(styles, sequence_parallel))
    if model.cfg.tied:  # each style distributed its own copy; both are Shard(0) of one weight: one again
        model.head.proj.weight = model.embed.tok.weight
    _replicate_rest(model, tp_mesh)
    # the loss leaves loss_parallel as a Replicate DTensor; the schedule adds plain tensors
    model.register_forward_hook(lambda _m, _a, out: out.to_local() if isinstance(out, DTensor) else out)
    return model, styles


def in_loss_parallel(schedule):
    """`schedule` run inside loss_parallel(), which must be active in forward and backward."""

    def scheduled(rank_model, microbatches, meters):
        with loss_parallel():
            return schedule(rank_model, microbatches, meters)

    return scheduled


class TorchTP:
    """GradSync for DTensor TP: torch.optim.AdamW and clip_grad_norm_ (DTensor-aware: shards'
    squared norms are summed over tp, replicas counted once)."""

    def __init__(self, module: nn.Module, mesh, optim: OptimConfig):
        self.modules = [module]
        self.tp, self.tp_rank = mesh.size("tp"), mesh.coord("tp")
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.clip = optim.clip
        self.opt = torch_adamw(self.names, self.params, optim)

    def microbatch(self, index: int, count: int):
        return nullcontext()  # no data parallelism: gradients simply accumulate

    def finish(self) -> None:
        pass

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def memory(self) -> dict[str, int]:
        state = [t for s in self.opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
        return {
            "params": unique_bytes(local(p) for p in self.params),
            "grads": unique_bytes(local(p.grad) for p in self.params if p.grad is not None),
            "optimizer": unique_bytes(local(t) for t in state),
        }

    def param_pieces(self, grads: bool = False) -> list[dict]:
        """Each parameter's local DTensor shard (its gradient's, with `grads`), placed by its Shard dim."""
        out = []
        for name, p in zip(self.names, self.params):
            shards = [pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()]
            box = shard_box(tuple(p.shape), shards[0], self.tp, self.tp_rank) if shards else None
            out.append(piece(name, tuple(p.shape), local(_laid_out_like(p, p.grad) if grads else p), box=box))
        return out

    def grad_pieces(self) -> list[dict]:
        return self.param_pieces(grads=True)

    def compute_pieces(self) -> None:
        return None  # fp32 only (labkit.config): forward reads the masters


def _laid_out_like(p: DTensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient placed as its parameter is (DTensor may leave it Replicate where the parameter
    is a Shard): this rank's part of it is then the part of the parameter it holds."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
        return grad.redistribute(p.device_mesh, p.placements)
    return grad
