"""Expert parallelism: the ep ranks share the experts (each holds E/ep) and split the batch.

GShard (Lepikhin et al. 2020, section 2.2) and Switch Transformer (Fedus et al. 2021, section
2.2): every rank routes its own tokens, sends each (token, expert) assignment to the rank that
holds the expert with one all-to-all, runs its experts on what arrives, and sends the results
back with a second all-to-all. Dropless (MegaBlocks, Gale et al. 2022): the number of rows a
rank sends to each other rank varies from step to step, so the ranks first exchange their
per-expert counts (a small all-to-all) and then call all_to_all_single with those split sizes.

Gradients: the router, attention and every dense weight are replicas over ep (each ep rank
saw different tokens), reduced over dp x ep x cp as usual; an expert's weights live on one ep
rank and their gradient already holds every ep rank's tokens (the backward all-to-all brought
them), so it is reduced over dp x cp only (ParamMeta.reduce). Under tensor parallelism the MoE
layer is replicated over tp (layout/tensor.py): each tp rank runs this all-to-all with the ep
ranks of its own tp coordinate, and the experts keep TP's replica mark for the norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.engines.moe import MoE
from labkit.engines.parallel.common import ParamMetas


class _AllToAll(torch.autograd.Function):
    """all_to_all_single forward; the reverse all-to-all (split sizes swapped) backward."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)  # (N, h) -> (R, h)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)  # (R, h) -> (N, h)
        return back, None, None, None


class ExpertParallel:
    """MoE.dispatch over the ep group: rows out to the experts' ranks and back."""

    def __init__(self, group, ep: int, local: int):
        self.group, self.ep, self.local = group, ep, local

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = self.ep, self.local
        # rows (N, h) sorted by global expert e; expert e lives on ep rank e // local
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # (E,) -> (ep * local,): [source, my expert]
        got = got.view(ep, local)
        send = counts.view(ep, local).sum(dim=1).tolist()  # rows to each ep rank
        recv = got.sum(dim=1).tolist()  # rows from each ep rank
        arrived = _AllToAll.apply(rows, recv, send, self.group)  # (N, h) -> (R, h), by source, then expert
        pieces = arrived.split(got.flatten().tolist())  # ep * local blocks, (source, expert) order
        outs = [
            moe.expert(e, torch.cat([pieces[src * local + e] for src in range(ep)])) for e in range(local)
        ]  # each expert once, on all its rows
        parts = [o.split(got[:, e].tolist()) for e, o in enumerate(outs)]
        back = torch.cat([parts[e][src] for src in range(ep) for e in range(local)])  # (R, h), arrival order
        return _AllToAll.apply(back, send, recv, self.group)  # (R, h) -> (N, h)


def apply_ep(model: nn.Module, mesh, metas: ParamMetas) -> tuple[nn.Module, dict]:
    """Keep this ep rank's E/ep experts of every MoE layer (slices of the full seeded tensors),
    route through the all-to-all on the mesh's ep group, and mark in `metas` what the gradient
    reduction and the norm must know. Returns (model, the experts it keeps as data for the report)."""
    ep, rank = mesh.size("ep"), mesh.coord("ep")
    n_exp = model.cfg.experts
    local = n_exp // ep
    lo, hi = rank * local, (rank + 1) * local
    dispatch = ExpertParallel(mesh.group("ep"), ep, local)
    sharded = set()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name in ("w1", "w2", "w3", "w1_bias", "w3_bias", "w2_bias"):
            full = getattr(moe, name)
            if full is None:  # w3: SwiGLU experts only; the biases GPT-OSS's
                continue
            part = nn.Parameter(full.detach()[lo:hi].clone())  # (E, h, f) -> (E/ep, h, f)
            meta = metas[part]
            meta.full_shape = tuple(full.shape)
            meta.box = [[lo, hi]] + [[0, n] for n in full.shape[1:]]
            meta.reduce = ("dp", "cp")
            meta.replicas = tuple(metas[full].replicas)  # e.g. ('tp',): MoE replicated over tp
            setattr(moe, name, part)
            sharded.add(id(part))
        moe.dispatch = dispatch
    for p in model.parameters():  # everything else is the same on every ep rank: count it once in the norm
        if id(p) not in sharded:
            metas[p].replicas += ("ep",)
    return model, {"experts": [lo, hi]}
