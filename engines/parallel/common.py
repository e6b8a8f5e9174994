"""What every data-parallel flavour provides (the GradSync protocol), and the conventions that
let strategies compose.

Parameter metadata. A strategy that changes a parameter says so on the tensor, so that the
later steps (gradient reduction, clipping, checking) need not know which strategy made it:
  _lk_name        its name in the full model (set when a strategy renames modules)
  _lk_full_shape  the full tensor's shape, and
  _lk_box         [start, stop) per dim of the full tensor that this rank holds (TP, EP slices)
  _lk_reduce      mesh dims its gradient is summed over before dividing by the loss shards
                  (default ('dp', 'ep', 'cp'): every dim whose ranks see different tokens;
                  an expert's: ('dp', 'cp'); a sequence-parallel LayerNorm's adds 'tp')
  _lk_replicas    mesh dims over which other ranks hold the same values (a TP-replicated
                  LayerNorm: ('tp',)); the global gradient norm counts it on one of them only
  _lk_tp_share    k: the same slice is held by runs of k consecutive tp ranks (a KV head when
                  tp > kv_heads); counted on the first of each run
  _lk_tied        the copy of a tied embedding on the first or the last pipeline stage: its
                  gradient is all-reduced over the two (`tied_params`, Megatron's embedding group)
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist

from labkit.plans.mesh import DATA_DIMS

# torch 2.13 names these all_gather_single / reduce_scatter_single and deprecates the old names,
# which are all that torch 2.6 to 2.12 have (pyproject allows >= 2.6; torch 2.11 on an H100 had
# no all_gather_single). Both names reach the same c10d ops (_allgather_base_,
# _reduce_scatter_base_), which the comm meter calls all_gather and reduce_scatter.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GradSync(Protocol):
    """Turns the gradients of every microbatch into one optimizer update on this rank: what every
    data-parallel step of parallelize returns (DDP, ZeRO, FSDP, and PyTorch's).

    The schedule calls `microbatch(i, m)` around the forward+backward of microbatch i of m
    (reduction happens only in the last, as DDP's no_sync does), `finish()` once backward is
    over, then `step()`; `memory()` and `param_pieces()` report after the step.
    """

    modules: list[torch.nn.Module]
    """What runs forward: this rank's chunks, wrapped where the strategy wraps them (PyTorch's DDP)."""

    def microbatch(self, index: int, count: int) -> AbstractContextManager: ...

    def finish(self) -> None: ...

    def step(self) -> float:
        """Clip by the global norm, update, zero the grads; return the norm before clipping."""

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's persistent 'params', 'grads' and 'optimizer' state."""

    def param_pieces(self) -> list[dict]:
        """This rank's part of every parameter after the step (see `piece`): the Lab assembles the full
        parameters from every rank's, to check them against the reference. The masters: the fp32
        weights the optimizer updates."""

    def grad_pieces(self) -> list[dict]:
        """This rank's part of every parameter's gradient between `finish()` and `step()`: reduced
        over its group and divided by the loss shards, before clipping (labkit/oracle/checks.py compares the
        first step's with the reference's, tensor by tensor)."""

    def compute_pieces(self) -> list[dict] | None:
        """This rank's part of the weights forward reads, after the step, where they are not the
        masters themselves (bf16 working copies; ZeRO's all-gathered buffers; ZeRO-3 / FSDP units
        gathered once more); None where they are (fp32 DDP) or where PyTorch makes them inside its
        own forward and frees them (FSDP2). Called on every rank in the same order: a ZeRO-3 / FSDP
        unit is all-gathered here."""


def full_name(p: torch.nn.Parameter, fallback: str) -> str:
    """The parameter's name in the full model (strategies that rename modules set `_lk_name`)."""
    return getattr(p, "_lk_name", fallback)


def reduce_dims(p: torch.Tensor) -> tuple[str, ...]:
    return getattr(p, "_lk_reduce", DATA_DIMS)


def piece(name: str, full_shape, values: torch.Tensor, box=None, flat=None) -> dict:
    """A part of a full parameter: `box` is [start, stop) per tensor dim, `flat` a [start, stop)
    range of the flattened tensor, both a flat range of the box (a ZeRO shard of a TP slice);
    neither means the whole tensor."""
    return {
        "name": name,
        "shape": list(full_shape),
        "box": box,
        "flat": flat,
        # to the host in its own dtype (no device memory), then a fresh fp32 copy: a numpy view of
        # the tensor's own storage would leave it unresizable, and ZeRO-3 frees units by resizing
        "values": values.detach().cpu().to(torch.float32, copy=True).numpy(),
    }


def param_piece(name: str, p: torch.Tensor, values: torch.Tensor | None = None) -> dict:
    """The piece a (possibly sliced) parameter holds (see `_lk_full_shape` / `_lk_box`); `values`
    replaces its own (its fp32 master under mixed precision)."""
    shape = getattr(p, "_lk_full_shape", tuple(p.shape))
    return piece(full_name(p, name), shape, p if values is None else values, box=getattr(p, "_lk_box", None))


def norm_plan(params: list[torch.Tensor], mesh, sharded: bool = False):
    """How to assemble the global gradient norm with each parameter counted once.

    Returns (group, counted): `group` spans the dims over which parameters are split (tp, pp,
    ep; with `sharded` — ZeRO / FSDP, whose buffers are sharded over each parameter's reduce
    dims — dp and cp too) or is None when nothing is split; `counted[i]` is False where
    parameter i is a replica that another rank in `group` counts: a replica dim (`_lk_replicas`)
    counts only at coordinate 0, unless the parameter is sharded over it (then every rank
    holds a different slice: a dense weight under ZeRO x EP, a sequence-parallel LayerNorm).
    """
    split = tuple(d for d in ("tp", "pp", "ep", *(("dp", "cp") if sharded else ())) if mesh.size(d) > 1)
    coords = mesh.coords

    def counts(p) -> bool:
        over = reduce_dims(p) if sharded else ()
        share = getattr(p, "_lk_tp_share", 1)  # a KV head held by `share` consecutive tp ranks
        return coords["tp"] % share == 0 and all(
            coords[d] == 0 for d in getattr(p, "_lk_replicas", ()) if d in split and d not in over
        )

    group = mesh.group(*split) if split else None
    return group, [counts(p) for p in params]


def tied_params(params: list[torch.Tensor], mesh) -> tuple[object, set[int]]:
    """(the group of the first and last pipeline stage, ids of the tied embedding copies among
    `params`): engines/parallel/pipeline.py `split_model` marks them. (None, {}) without any."""
    tied = {id(p) for p in params if getattr(p, "_lk_tied", False)}
    return (mesh.ends_group("pp") if tied else None), tied


def all_reduce_tied(grad: torch.Tensor, group) -> None:
    """Sum a tied embedding's gradient over its two pipeline stages (Megatron-LM's embedding
    group), in place, in fp32 (the reduce dtype: engines/precision.py)."""
    total = grad if grad.dtype == torch.float32 else grad.float()
    dist.all_reduce(total, group=group)  # (V/t, h): the embedding's part + the head's part
    if total is not grad:
        grad.copy_(total)


def on_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`module` on `device`, moved only if it is elsewhere (a module already there is returned as
    is: the dry run's fake parameters cannot be re-wrapped by Module.to)."""
    first = next(module.parameters(), None)
    return module if first is None or first.device == device else module.to(device)


def weak_method(obj, name: str, *bound):
    """A callback that calls obj.<name>(*bound, *args) while obj lives, and does nothing after.

    For hooks on parameters: those are owned by the C++ tensor, so a strong reference back to
    the strategy object is a cycle Python's garbage collector cannot see, and every run's model,
    gradients and process groups would stay alive on the engine (measured: the soak test's RSS)."""
    ref = weakref.ref(obj)

    def call(*args):
        target = ref()
        if target is not None:
            return getattr(target, name)(*bound, *args)

    return call
