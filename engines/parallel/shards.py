"""The optimizer side of sharded data parallelism (ZeRO, FSDP): flat buffers as tensors, and the
master slice, AdamW, global norm and pieces of the slice a rank owns (layout: layout/flat.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.config import OptimConfig
from labkit.engines.muon import ShardedMuon
from labkit.engines.optim import AdamW, clip_coefficient, grad_norm
from labkit.engines.parallel.common import ParamMetas, norm_terms, piece
from labkit.layout.flat import FlatLayout
from labkit.layout.mesh import shard_dims


def flatten(layout: FlatLayout, params: dict[str, nn.Parameter], dtype=torch.float32) -> torch.Tensor:
    """The layout's parameters end to end, zero-padded: (padded,)."""
    device = params[layout.names[0]].device
    flat = torch.zeros(layout.padded, dtype=dtype, device=device)
    for name, _, lo, hi in layout.offsets():
        flat[lo:hi].copy_(params[name].detach().reshape(-1))
    return flat


def bind(layout: FlatLayout, params: dict[str, nn.Parameter], flat: torch.Tensor, grads: bool = False) -> None:
    """Make each parameter (or its .grad) a view of its range of `flat`."""
    for name, shape, lo, hi in layout.offsets():
        if grads:
            params[name].grad = flat[lo:hi].view(shape)
        else:
            params[name].data = flat[lo:hi].view(shape)


def hybrid(mesh) -> bool:
    """HSDP: the dp ranks are replicas of shard groups (ParallelConfig.dp_replicate > 1)."""
    return mesh.size("dp_replicate") > 1


def entries(named: list[tuple[str, nn.Parameter]], metas: ParamMetas, mesh) -> list[tuple[str, tuple, tuple, int]]:
    """(full name, local shape, shard dims, pipeline chunk) of each parameter, as layout/flat.py takes
    them: its reduce dims, with dp's shard sub-dim in dp's place under HSDP (layout/mesh.py shard_dims)."""
    h = hybrid(mesh)
    return [(metas[p].full_name(n), tuple(p.shape), shard_dims(metas[p].reduce, h), metas[p].chunk) for n, p in named]


def group_sizes(mesh, named, metas: ParamMetas) -> dict[tuple, int]:
    """{shard dims: size of that group} for every shard group among `named`'s parameters (`entries`)."""
    dims = {shard_dims(metas[p].reduce, hybrid(mesh)) for _, p in named}
    return {d: mesh.size(*d) for d in dims}


def layout_group(mesh, layout: FlatLayout):
    """(group, N, this rank's shard index) of a flat buffer: the ranks of its shard dims."""
    return mesh.group(*layout.dims), mesh.size(*layout.dims), mesh.ranks(*layout.dims).index(mesh.rank)


def replica_group(mesh, layout: FlatLayout):
    """HSDP: the group across which a buffer's reduce-scattered shard is all-reduced (the replicas
    of its shard group, dp_replicate), or None without HSDP."""
    return mesh.group("dp_replicate") if "dp_shard" in layout.dims else None


def all_reduce_replicas(shard: torch.Tensor, group) -> None:
    """HSDP's second half: the shard, already summed over its shard group, summed over the replicas
    too, in place, in the reduce dtype (torchtitan's HSDP, FSDP2's all_reduce_group)."""
    if group is not None:
        dist.all_reduce(shard, group=group)  # (shard,) summed over dp_replicate


class ShardedOptimizer:
    """The optimizer over this rank's slice of every flat buffer: the master weights (fp32), AdamW
    over them with the decay mask as runs (layout/flat.py), the global norm, and the slices as pieces of
    the full parameters (for checking).

    `params` (full name -> parameter) and their records (`metas`) give what the norm and the pieces
    need to know of each parameter: whether this rank counts it in the norm (norm_terms), and where
    its local tensor sits in the full one (a TP or EP slice: ParamMeta.box)."""

    def __init__(
        self,
        layouts: list[FlatLayout],
        indices: list[int],
        masters: list[torch.Tensor],
        mesh,
        params: dict[str, nn.Parameter],
        metas: ParamMetas,
        optim: OptimConfig,
        groups: list | None = None,
    ):
        self.layouts, self.indices, self.masters = layouts, indices, masters
        names = list(params)
        self.norm_group, counted = norm_terms([metas[params[n]] for n in names], mesh, sharded=True)
        self.counted = dict(zip(names, counted))
        self.where = {  # full name -> (the full shape, the box this rank's tensor is of it)
            n: (tuple(p.shape) if metas[p].full_shape is None else metas[p].full_shape, metas[p].box)
            for n, p in params.items()
        }
        self.clip = optim.clip
        # Muon's pieces (Distributed Muon, engines/muon.py ShardedMuon; `groups`: each buffer's shard group),
        # AdamW for the rest of each slice
        self.muon = ShardedMuon(layouts, indices, masters, groups, optim) if optim.kind.muon else None
        self.adam_runs = [
            (k, lo, hi, d)
            for k, (p, i) in enumerate(zip(layouts, indices))
            for a, b, d in p.runs(i)
            for lo, hi in _without(a, b, self.muon.intervals(k) if self.muon else [])
        ]
        self.opt = AdamW([masters[k][lo:hi] for k, lo, hi, _ in self.adam_runs], optim, [d for *_, d in self.adam_runs])

    def step(self, grads: list[torch.Tensor]) -> float:
        """Clip by the global norm and update the masters. Within a buffer's group the slices are
        disjoint, so the norm is the sum of every rank's squares (one scalar all-reduce) over the
        parameters this rank counts (not a TP replica another rank counts); padding is left out."""
        mine = [
            g[at : at + hi - lo]
            for p, i, g in zip(self.layouts, self.indices, grads)
            for name, _, lo, hi, at in p.pieces(i)
            if self.counted[name]
        ]
        norm = grad_norm(mine, None, self.norm_group)
        scale = clip_coefficient(norm, self.clip)
        self.opt.step([grads[k][lo:hi] for k, lo, hi, _ in self.adam_runs], scale)
        if self.muon is not None:
            self.muon.step(grads, scale)
        return float(norm)

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's state: AdamW's moments, and Muon's momentum where it runs."""
        return self.opt.state_tensors() + (self.muon.state_tensors() if self.muon else [])

    def param_pieces(self, slices: list[torch.Tensor] | None = None) -> list[dict]:
        """A flat range of each (possibly TP / EP sliced) local tensor; `box` places it in the full one.
        `slices`: this rank's slice of each buffer to read (default: the masters; the gradient shards)."""
        out = []
        for p, i, m in zip(self.layouts, self.indices, self.masters if slices is None else slices):
            for name, _shape, lo, hi, at in p.pieces(i):
                full, box = self.where[name]
                out.append(piece(name, full, m[at : at + hi - lo], box=box, flat=[lo, hi]))
        return out

    def whole_pieces(self, layout: FlatLayout, flat: torch.Tensor) -> list[dict]:
        """Every parameter of a whole (gathered) buffer `flat` (padded,), each as its local tensor."""
        out = []
        for name, shape, lo, hi in layout.offsets():
            full, box = self.where[name]
            out.append(piece(name, full, flat[lo:hi].view(shape), box=box))
        return out


def _without(a: int, b: int, cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[a, b) less the intervals `cuts` (disjoint, in order), as the runs that are left."""
    out = []
    for lo, hi in cuts:
        if lo >= b or hi <= a:
            continue
        if lo > a:
            out.append((a, lo))
        a = max(a, hi)
    if b > a:
        out.append((a, b))
    return out
