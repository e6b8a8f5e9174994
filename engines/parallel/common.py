"""What every data-parallel flavour provides (the GradSync protocol), and the conventions that
let strategies compose: the parameters' metadata (`ParamMeta`, one record per parameter, kept in
the run's `ParamMetas`), which strategies that change a parameter write and the later steps
(gradient reduction, clipping, checking) read, so that those need not know which strategy made it.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from labkit.layout.mesh import DATA_DIMS

# torch 2.13 names these all_gather_single / reduce_scatter_single and deprecates the old names,
# which are all that torch 2.6 to 2.12 have (pyproject allows >= 2.6; torch 2.11 on an H100 had
# no all_gather_single). Both names reach the same c10d ops (_allgather_base_,
# _reduce_scatter_base_), which the comm meter calls all_gather and reduce_scatter.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(slots=True)
class ParamMeta:
    """What the strategies that changed one parameter say about it.

    The words: the *full* parameter is the one-process model's tensor, under its name there; a
    rank's *local* parameter is what the rank holds of it, the whole tensor or a TP / EP slice
    (`box`). A parameter no strategy marked keeps every default: whole, named as its module names
    it, reduced over every data dim, held by no other rank. Slotted: a misspelt field is an
    AttributeError, read or written.
    """

    name: str | None = None
    """Its name in the full model where a strategy renamed its module (a pipeline chunk's); None:
    the name its module gives it."""
    full_shape: tuple[int, ...] | None = None
    """The full tensor's shape where this rank holds a slice (TP, EP); None: the tensor is whole."""
    box: list[list[int]] | None = None
    """[start, stop) per dim of the full tensor that this rank holds, beside `full_shape`."""
    reduce: tuple[str, ...] = DATA_DIMS
    """Mesh dims its gradient is summed over before dividing by the loss shards: every dim whose
    ranks see different tokens; an expert's ('dp', 'cp'); a sequence-parallel LayerNorm's adds 'tp'."""
    replicas: tuple[str, ...] = ()
    """Mesh dims over which other ranks hold the same values (a TP-replicated LayerNorm: ('tp',));
    the global gradient norm counts it on one of them only."""
    tp_share: int = 1
    """k: the same slice is held by runs of k consecutive tp ranks (a KV head when tp > kv_heads);
    counted on the first of each run."""
    chunk: int = 0
    """Which of this rank's pipeline chunks holds it: DDP and ZeRO bucket per chunk."""
    tied: bool = False
    """The copy of a tied embedding on the first or the last pipeline stage: its gradient is
    all-reduced over the two (`tied_params`, Megatron's embedding group)."""

    def full_name(self, local: str) -> str:
        """Its name in the full model, given the one its module gives it."""
        return local if self.name is None else self.name


class ParamMetas:
    """This rank's ParamMeta of every parameter, looked up by the parameter itself.

    parallelize makes one per run and passes it, as it passes the mesh (no module-level registry:
    parallel state is an argument, never a global); the strategies that change parameters (TP,
    EP, the pipeline's split) write into it and the data-parallel step keeps it. It lives beside
    the model, not on the tensors: attributes stuck on a tensor and read back with getattr and a
    default turn a misspelt name into a silent default. Keyed by identity and held weakly (torch's
    WeakIdKeyDictionary; a plain WeakKeyDictionary compares keys with ==, elementwise on
    tensors): a parameter a strategy replaced (TP's full weight, by its slice) leaves with its
    record, and a new tensor at a freed one's address never inherits it.
    """

    def __init__(self):
        self._of = WeakIdKeyDictionary()

    def __getitem__(self, p: torch.Tensor) -> ParamMeta:
        """p's record, made with the defaults on first use; read it, or change it in place."""
        meta = self._of.get(p)
        if meta is None:
            meta = self._of[p] = ParamMeta()
        return meta


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


def param_piece(name: str, p: torch.Tensor, meta: ParamMeta, values: torch.Tensor | None = None) -> dict:
    """The piece a (possibly sliced) parameter holds, placed by its record (`meta`); `values`
    replaces its own (its fp32 master under mixed precision)."""
    shape = tuple(p.shape) if meta.full_shape is None else meta.full_shape
    return piece(meta.full_name(name), shape, p if values is None else values, box=meta.box)


def norm_terms(records: list[ParamMeta], mesh, sharded: bool = False):
    """How to assemble the global gradient norm with each parameter counted once, from the
    parameters' records.

    Returns (group, counted): `group` spans the dims over which parameters are split (tp, pp,
    ep; with `sharded` — ZeRO / FSDP, whose buffers are sharded over each parameter's reduce
    dims — dp and cp too) or is None when nothing is split; `counted[i]` is False where
    parameter i is a replica that another rank in `group` counts: a replica dim (`replicas`)
    counts only at coordinate 0, unless the parameter is sharded over it (then every rank
    holds a different slice: a dense weight under ZeRO x EP, a sequence-parallel LayerNorm).
    """
    # under HSDP a shard is held by every replica: the norm sums the shard group's squares only
    dp = "dp_shard" if mesh.size("dp_replicate") > 1 else "dp"
    split = tuple(d for d in ("tp", "pp", "ep", *((dp, "cp") if sharded else ())) if mesh.size(d) > 1)
    coords = mesh.coords

    def counts(meta: ParamMeta) -> bool:
        over = meta.reduce if sharded else ()
        first_of_run = coords["tp"] % meta.tp_share == 0  # a KV head held by `tp_share` consecutive tp ranks
        return first_of_run and all(coords[d] == 0 for d in meta.replicas if d in split and d not in over)

    group = mesh.group(*split) if split else None
    return group, [counts(m) for m in records]


def tied_params(params: list[torch.Tensor], metas: ParamMetas, mesh) -> tuple[object, set[int]]:
    """(the group of the first and last pipeline stage, ids of the tied embedding copies among
    `params`): engines/parallel/pipeline/ `split_model` marks them. (None, {}) without any."""
    tied = {id(p) for p in params if metas[p].tied}
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
