"""FSDP: fully sharded data parallelism in per-block units, ours and PyTorch's FSDP2.

FSDP (Zhao et al., "PyTorch FSDP", VLDB 2023) is ZeRO stage 3 organised by modules: each
transformer block is a unit with its own flat buffer, and a root unit holds what is left (the
embedding and the head). A unit is all-gathered just before its forward; with
reshard_after_forward on it is freed after it and gathered again for backward (ZeRO-3's 3Ψ
traffic, one unit in memory at a time); with it off the gathered parameters stay until the
unit's backward is done (2Ψ traffic, like ZeRO-2, but the whole model is gathered at the end
of forward). Gradients are reduce-scattered per unit as its backward finishes.

impl='lab' runs our units (zero.py, `ZeRO3` with the fsdp grouping). impl='torch' runs
PyTorch's FSDP2: `fully_shard` on each block, then on the model, on a DeviceMesh wrapped around
the mesh's own dp process group (no new groups), with `MixedPrecisionPolicy` for bf16
(bf16 parameters for compute, bf16 reduce-scatter, fp32 sharded masters; see precision.py).
HSDP (dp_replicate > 1): ours shard each unit over the shard group and all-reduce the reduced
shard over the replicas (zero3.py); FSDP2 gets a 2-D (dp_replicate, dp_shard) DeviceMesh and does
the same (its reduce-scatter over dim 1, then an all-reduce over dim 0).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.config import OptimConfig
from labkit.engines.float8 import torchao_float8
from labkit.engines.meters.memory import plain, unique_bytes
from labkit.engines.optim import torch_adamw
from labkit.engines.parallel.common import ParamMetas, piece
from labkit.engines.parallel.zero3 import ZeRO3
from labkit.engines.precision import Policy
from labkit.layout.mesh import DATA_DIMS
from labkit.layout.tensor import shard_box


def apply_fsdp(
    chunks: list[nn.Module],
    mesh,
    metas: ParamMetas,
    *,
    reshard: bool,
    pol: Policy,
    optim: OptimConfig,
    meters,
    loss_shards: int,
    float8=None,
) -> ZeRO3:
    """sharding='fsdp', impl='lab': our units (a ZeRO-3 per block plus the root) over this rank's
    pipeline chunks, as its GradSync; with a pipeline each unit stays gathered over the step and is
    reduced once, whatever `reshard` says (zero3.py)."""
    keep = mesh.size("pp") > 1
    return ZeRO3(
        chunks,
        mesh,
        metas,
        kind="fsdp",
        reshard=reshard,
        pol=pol,
        optim=optim,
        meters=meters,
        loss_shards=loss_shards,
        keep=keep,
        float8=float8,
    )


def apply_fsdp_torch(
    model: nn.Module, mesh, *, reshard: bool, pol: Policy, optim: OptimConfig, meters, float8: bool = False
) -> TorchFSDP:
    """sharding='fsdp', impl='torch': FSDP2's fully_shard, as this rank's GradSync (FSDP2 averages the
    gradients over its own mesh, so it needs no loss_shards). `float8`: the model's torchao Float8Linear
    weights are gathered in fp8 (enable_fsdp_float8_all_gather), their scales precomputed per step."""
    return TorchFSDP(model, mesh, reshard, pol, optim, meters, float8)


class TorchFSDP:
    """PyTorch's FSDP2 with torch.optim.AdamW and clip_grad_norm_, as a user would write it.

    What the meters need from it: FSDP2 swaps a unit's parameters for unsharded ones (views of
    its all-gather output; TP DTensors under 2-D) around the unit's forward and backward. A
    forward pre-hook that runs after FSDP2's (which is prepended) tells the memory meter those
    storages are parameters, not activations; and the param group's switch to and from
    unsharded is tracked as 'gathered' (FSDP2's flat all-gather buffer, briefly alive beside it,
    is not counted)."""

    def __init__(
        self, model: nn.Module, mesh, reshard: bool, pol: Policy, optim: OptimConfig, meters, float8: bool = False
    ):
        # Deferred to FSDP2 runs: once torch.distributed.fsdp is imported (it pulls in torch.distributed.nn
        # and _shard), a rank whose peer died keeps its gloo groups past destroy_process_group, so the
        # Lab's repair replaces every engine instead of the dead one (measured: tests/test_soak.py's kill).
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device_type = next(model.parameters()).device.type
        if mesh.size("dp_replicate") > 1:  # HSDP: FSDP2 on (dp_replicate, dp_shard), as torchtitan
            dm = mesh.device_mesh_hsdp(device_type)
        elif mesh.size("tp") > 1:  # 2-D: the dp slice of the mesh DTensor TP used (tensor/dtensor.py)
            dm = mesh.device_mesh_2d(device_type)["dp"]
        else:
            dm = DeviceMesh.from_group(mesh.group(*DATA_DIMS), device_type)
        mp = (
            MixedPrecisionPolicy(param_dtype=pol.compute, reduce_dtype=pol.reduce)
            if pol.mixed
            else MixedPrecisionPolicy()
        )
        self.meters = meters
        shard = dm.ndim - 1  # the dim FSDP2 shards over (the last, under HSDP); the first replicates
        self.dp, self.dp_rank = dm.size(shard), dm.get_local_rank(shard)
        self.tp_box = {n: _tp_box(p, mesh) for n, p in model.named_parameters()}  # before FSDP2 wraps them
        for unit in [*model.blocks, model]:
            fully_shard(unit, mesh=dm, reshard_after_forward=reshard, mp_policy=mp)
            unit.register_forward_pre_hook(self._exclude_unsharded)
            self._track_gathered(unit)
        self.modules = [model]
        self.float8 = self.stale = float8  # the fp8 weights' scales, once per step (torchtitan: after the optimizer)
        if float8:
            # before FSDP2's own pre-forward, whose all-gather casts each weight with its scale
            model.register_forward_pre_hook(self._precompute_scales, prepend=True)
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.clip = optim.clip
        self.opt = torch_adamw(self.names, self.params, optim)

    def _precompute_scales(self, module, args) -> None:
        """torchao's precompute_float8_dynamic_scale_for_fsdp, at the step's first forward: one
        all-reduce (MAX) of every fp8 weight's amax of its fp32 shard (torchtitan calls it after each
        optimizer step; here the first step's scales are precomputed too, so every step is alike)."""
        if self.stale:
            torchao_float8().fsdp.precompute_float8_dynamic_scale_for_fsdp(module)
            self.stale = False

    def _exclude_unsharded(self, module, args) -> None:
        """Every parameter the unit now shows is a parameter, not an activation: plain tensors with
        FSDP2 alone, DTensors on the tp mesh under FSDP x TP (their local storage is what autograd
        saves; excluding an already excluded sharded one changes nothing). Of torchao's fp8 weights
        only the values (the first inner tensor: the fp8 bytes of a gathered Float8TrainingTensor, the
        fp32 shard of a WeightWithDynamicFloat8CastTensor; their scale comes after): the scale is the
        step's precomputed one, a new tensor every step, and the meter knows storages by address,
        which a freed storage hands on to the next (an activation then went uncounted)."""
        self.meters.memory.exclude(plain(p)[0] for p in module.parameters())

    def _track_gathered(self, unit: nn.Module) -> None:
        """Count the unit's unsharded parameters while FSDP2 holds them (its param group's private
        _to_unsharded / _to_sharded; skipped if a PyTorch version names them differently)."""
        group = getattr(unit._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None or not hasattr(group, "_to_unsharded") or not hasattr(group, "_to_sharded"):
            return
        meter, held = self.meters.memory, [0]
        to_unsharded, to_sharded = group._to_unsharded, group._to_sharded

        def unsharded():
            was = group.is_unsharded
            to_unsharded()
            if not was:
                held[0] = unique_bytes(t for fp in group.fsdp_params for t in fp.all_gather_outputs)
                meter.track("gathered", held[0])

        def sharded():
            was = group.is_sharded
            to_sharded()
            if not was and held[0]:
                meter.track("gathered", -held[0])
                held[0] = 0

        group._to_unsharded, group._to_sharded = unsharded, sharded

    def microbatch(self, index: int, count: int):
        return nullcontext()  # FSDP2 reduce-scatters every microbatch by default, as ours does

    def finish(self) -> None:
        pass  # FSDP2 waits for its reduce-scatters at the end of backward

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.stale = self.float8  # the weights moved: their scales again at the next forward
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @torch.no_grad()
    def memory(self) -> dict[str, int]:
        state = [t for s in self.opt.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")]
        return {
            "params": unique_bytes(p.to_local() for p in self.params),
            "grads": unique_bytes(p.grad.to_local() for p in self.params if p.grad is not None),
            "optimizer": unique_bytes(t.to_local() for t in state),
        }

    @torch.no_grad()
    def param_pieces(self, grads: bool = False) -> list[dict]:
        """Each parameter (its TP slice under 2-D) is split on dim 0 in chunks of ceil(d0 / N) rows
        (FSDP2's Shard(0) over dp); `grads`: their gradients instead, sharded alike."""
        out = []
        for name, p in zip(self.names, self.params):
            # torchao's fp8 weights are a wrapper (WeightWithDynamicFloat8CastTensor) around the fp32 shard
            (local,) = plain((p.grad if grads else p).to_local())
            if local.shape[0] == 0:
                continue
            box = [list(b) for b in self.tp_box[name]]
            start = box[0][0] + -(-(box[0][1] - box[0][0]) // self.dp) * self.dp_rank
            box[0] = [start, start + local.shape[0]]
            out.append(piece(name, p.shape, local, box=box))
        return out

    def grad_pieces(self) -> list[dict]:
        return self.param_pieces(grads=True)

    def compute_pieces(self) -> None:
        return None  # FSDP2 casts and gathers inside its own forward and frees them after


def _tp_box(p: torch.Tensor, mesh) -> list[list[int]]:
    """[start, stop) per dim of the slice this tp rank holds of a DTensor TP parameter (the whole
    tensor for a plain one or a Replicate one)."""
    shards = [pl.dim for pl in getattr(p, "placements", ()) if pl.is_shard()]
    if not shards:
        return [[0, d] for d in p.shape]
    return shard_box(tuple(p.shape), shards[0], mesh.size("tp"), mesh.coord("tp"))
