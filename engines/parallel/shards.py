"""The optimizer side of sharded data parallelism (ZeRO, FSDP): flat buffers as tensors, and the
master slice, AdamW, global norm and pieces of the slice a rank owns (layout: flat.py)."""
from __future__ import annotations

import torch
import torch.nn as nn

from labkit.config import OptimConfig
from labkit.engines.optim import AdamW, clip_coefficient, grad_norm
from labkit.engines.parallel.common import DATA_DIMS, piece, reduce_dims
from labkit.engines.parallel.flat import FlatPlan


def flatten(plan: FlatPlan, params: dict[str, nn.Parameter], dtype=torch.float32) -> torch.Tensor:
    """The plan's parameters end to end, zero-padded: (padded,)."""
    device = params[plan.names[0]].device
    flat = torch.zeros(plan.padded, dtype=dtype, device=device)
    for name, _, lo, hi in plan.offsets():
        flat[lo:hi].copy_(params[name].detach().reshape(-1))
    return flat


def bind(plan: FlatPlan, params: dict[str, nn.Parameter], flat: torch.Tensor, grads: bool = False) -> None:
    """Make each parameter (or its .grad) a view of its range of `flat`."""
    for name, shape, lo, hi in plan.offsets():
        if grads:
            params[name].grad = flat[lo:hi].view(shape)
        else:
            params[name].data = flat[lo:hi].view(shape)


class Shards:
    """This rank's slice of every flat buffer on the optimizer side: the master weights (fp32),
    AdamW over them with the decay mask as runs (flat.py), the global norm and the pieces."""

    def __init__(self, plans: list[FlatPlan], index: int, masters: list[torch.Tensor], norm_group,
                 optim: OptimConfig):
        self.plans, self.index, self.masters = plans, index, masters
        self.norm_group = norm_group
        self.clip = optim.clip
        runs = [(m[lo:hi], d) for p, m in zip(plans, masters) for lo, hi, d in p.runs(index)]
        self.opt = AdamW([r for r, _ in runs], optim, [d for _, d in runs])

    def step(self, grads: list[torch.Tensor]) -> float:
        """Clip by the global norm and update the masters. The slices are disjoint, so the norm is
        the sum of every rank's squares (one scalar all-reduce); padding is left out."""
        real = [g[:p.real(self.index)] for p, g in zip(self.plans, grads)]
        norm = grad_norm(real, None, self.norm_group)
        runs = [g[lo:hi] for p, g in zip(self.plans, grads) for lo, hi, _ in p.runs(self.index)]
        self.opt.step(runs, clip_coefficient(norm, self.clip))
        return float(norm)

    def pieces(self) -> list[dict]:
        return [piece(name, shape, m[at:at + hi - lo], flat=[lo, hi])
                for p, m in zip(self.plans, self.masters) for name, shape, lo, hi, at in p.pieces(self.index)]


def data_group(mesh, params):
    """(group, N, this rank's shard index): the ranks that shard and reduce the gradients, dp x ep
    x cp, every dense parameter's reduce dims. Sliced parameters (tensor / expert parallelism)
    are not sharded yet (labkit.config refuses those layouts)."""
    params = list(params)
    odd = {reduce_dims(p) for p in params} - {DATA_DIMS}
    if odd or any(hasattr(p, "_lk_box") for p in params):
        raise NotImplementedError(f"ZeRO/FSDP shard whole parameters over {DATA_DIMS}; parameters reduced "
                                  f"over {odd or 'other dims'} or sliced by tp/ep are not supported yet")
    group = mesh.group(*DATA_DIMS)
    return group, mesh.size(*DATA_DIMS), mesh.ranks(*DATA_DIMS).index(mesh.rank)
