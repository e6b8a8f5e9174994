"""Muon on a rank: torch.optim.Muon's update (torch 2.13, torch/optim/_muon.py `_single_tensor_muon`) for the
matrices labkit/layout/optimizer.py routes to it, each orthogonalized whole, and labkit's AdamW for the rest.

Muon's update of a matrix W with gradient G (Jordan et al. 2024; Liu et al. 2025, arXiv 2502.16982):
    B <- lerp(B, G, 1 - mu)                    the momentum buffer (fp32, the shape of the rank's piece)
    U <- lerp(G, B, mu) (Nesterov) or B
    O <- NS5(U)                                Newton-Schulz, 5 quintic steps in bf16, on the WHOLE matrix
    W <- W (1 - lr wd) - lr ratio(A, B) O      ratio: adjust_lr's, A x B = out x in
Everything but NS5 is elementwise, so each rank does it on its own piece. NS5 is not: it orthogonalizes the
full matrix, so a tp rank holding a column or row slice gathers the update's slices from its tp group first
(in bf16: NS5's first act is that cast, so gathering the cast is the same numbers at half the bytes), runs
NS5 on the whole and keeps its slice; every tp rank computes the same whole, the same way. An expert's rank
holds its experts whole. Each matrix's NS5 is torch's own function, so a whole matrix computed from the same
values gives the same bits as torch.optim.Muon on one process (tests/test_muon.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.optim._muon import _zeropower_via_newtonschulz

from labkit.config import OptimConfig
from labkit.config.optimizers import muon_lr_ratio
from labkit.engines.optim import AdamW
from labkit.layout.optimizer import matrices, takes_muon

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
"""torch.optim.Muon's quintic Newton-Schulz coefficients (Jordan et al.'s), its default and labkit's."""
NS_EPS = 1e-7
"""torch.optim.Muon's eps, the floor of the norm the update is divided by before the iterations."""


class Whole:
    """One Muon parameter as the rank holds it: how its update's piece becomes the whole parameter and back.
    `group`: the ranks that hold its other slices (a tp group) and `boxes` each one's [start, stop) per dim,
    in the group's rank order; None for a piece that is the whole (DDP, a pipeline stage, experts whole)."""

    def __init__(self, full_shape: tuple[int, ...], box: list[list[int]] | None, group=None, boxes=None):
        self.full_shape, self.box, self.group, self.boxes = tuple(full_shape), box, group, boxes

    def gather(self, piece: torch.Tensor) -> torch.Tensor:
        """The whole update (full shape, bf16) from this rank's `piece` of it."""
        piece = piece.bfloat16()
        if self.group is None:
            return piece
        pieces = [torch.empty_like(piece) for _ in self.boxes]
        dist.all_gather(pieces, piece.contiguous(), group=self.group)  # (piece,) x n -> every rank's
        full = torch.empty(self.full_shape, dtype=piece.dtype, device=piece.device)
        for b, got in zip(self.boxes, pieces):  # a KV head shared by several tp ranks is written twice, alike
            full[tuple(slice(lo, hi) for lo, hi in b)] = got
        return full

    def mine(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole `full`."""
        if self.group is None:
            return full
        return full[tuple(slice(lo, hi) for lo, hi in self.box)]


def orthogonalized(update: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz (`steps` iterations) of each matrix of a whole parameter (layout/optimizer.py `matrices`):
    a 2-D weight as stored, an expert stack (E, in, out) expert by expert in a Linear's orientation (out, in),
    transposed back."""
    if update.dim() == 2:
        return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, steps, NS_EPS)
    return torch.stack([_zeropower_via_newtonschulz(u.T, NS_COEFFICIENTS, steps, NS_EPS).T for u in update])


class Muon:
    """torch.optim.Muon's update over this rank's pieces of the Muon parameters (fp32 masters)."""

    def __init__(self, params: list[torch.Tensor], wholes: list[Whole], cfg: OptimConfig):
        self.params, self.wholes, self.cfg = params, wholes, cfg
        self.bufs = [torch.zeros_like(p, dtype=torch.float32) for p in params]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], scale: float = 1.0) -> None:
        c = self.cfg
        for p, g, buf, w in zip(self.params, grads, self.bufs, self.wholes):
            g = g.float()
            if scale != 1.0:
                g = g * scale
            buf.lerp_(g, 1 - c.momentum)
            update = g.lerp(buf, c.momentum) if c.nesterov else buf
            ortho = w.mine(orthogonalized(w.gather(update), c.ns_steps))
            rows, cols = matrices("", w.full_shape)[0]
            p.mul_(1 - c.muon_lr * c.muon_weight_decay)
            p.add_(ortho, alpha=-c.muon_lr * muon_lr_ratio(c.adjust_lr, rows, cols))

    def state_tensors(self) -> list[torch.Tensor]:
        return list(self.bufs)


class Optimizer:
    """The run's optimizer over one rank's fp32 masters: AdamW, or Muon for the parameters the rule routes to
    it (`full`: each one's full name and shape; `wholes`: how each Muon parameter's piece is gathered, None:
    every piece is whole) and AdamW for the others. The interface of engines/optim.py's AdamW."""

    def __init__(self, params, decay, cfg: OptimConfig, full: list[tuple[str, tuple]], wholes=None):
        muon = [cfg.kind.muon and takes_muon(n, s) for n, s in full]
        self.muon_index = [i for i, m in enumerate(muon) if m]
        self.adam_index = [i for i, m in enumerate(muon) if not m]
        self.adam = AdamW([params[i] for i in self.adam_index], cfg, [decay[i] for i in self.adam_index])
        wholes = wholes or [Whole(full[i][1], None) for i in range(len(params))]
        self.muon = Muon([params[i] for i in self.muon_index], [wholes[i] for i in self.muon_index], cfg)

    @property
    def t(self) -> int:
        return self.adam.t

    @t.setter
    def t(self, value: int) -> None:
        self.adam.t = value

    def step(self, grads: list[torch.Tensor], scale: float = 1.0) -> None:
        self.adam.step([grads[i] for i in self.adam_index], scale)
        if self.muon_index:
            self.muon.step([grads[i] for i in self.muon_index], scale)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.adam.state_tensors() + self.muon.state_tensors()


def wholes_of(params: list[torch.Tensor], metas, mesh, muon: list[bool]) -> list[Whole | None]:
    """How each of a rank's Muon parameters (`muon[i]`) is made whole: a tp slice from its tp group (the
    slices' boxes exchanged once, in the parameters' order, the same on every tp rank), every other piece
    as it is (an expert stack split over ep holds its experts whole). None where Muon does not take it."""
    out: list[Whole | None] = []
    for p, m in zip(params, muon):
        meta = metas[p]
        if not m:
            out.append(None)
        elif meta.full_shape is None or _whole_matrices(meta.full_shape, meta.box):
            out.append(Whole(tuple(p.shape), None))
        else:
            group = mesh.group("tp")
            boxes = [None] * dist.get_world_size(group)
            dist.all_gather_object(boxes, meta.box, group=group)
            out.append(Whole(meta.full_shape, meta.box, group, boxes))
    return out


def _whole_matrices(full: tuple[int, ...], box: list[list[int]]) -> bool:
    """Whether a piece holds its matrices whole: every dim whole, but a stack's first (its experts)."""
    dims = range(1, len(full)) if len(full) == 3 else range(len(full))
    return all(box[d] == [0, full[d]] for d in dims)


class ShardedMuon:
    """Distributed Muon (Liu et al. 2025, "Muon is Scalable for LLM Training", section 2.2, Algorithm 1) over
    a ZeRO/FSDP rank's slices of its flat buffers (layout/flat.py): the momentum is kept on the slice (4
    bytes an element, elementwise: the same numbers as one process's), and each step every buffer that holds
    a Muon matrix all-gathers its slices' updates over the buffer's shard group ("DP Gather", in bf16:
    Newton-Schulz's first act is that cast, Whole.gather), so that each rank orthogonalizes whole every
    matrix it holds a part of and keeps its part ("calculate full update", then "discard the rest"). The
    paper gathers only the partitions of the matrices; labkit gathers each buffer's whole slice, one
    collective a buffer, zeros where AdamW's parameters lie (the theory prices what is sent:
    labkit/theory/exact/muon.py). Every piece here is a whole local tensor's (no tp slice: muon_problems)."""

    def __init__(self, layouts, indices, masters, groups, cfg: OptimConfig):
        self.layouts, self.indices, self.masters, self.groups, self.cfg = layouts, indices, masters, groups, cfg
        # per buffer: (name, local shape, the tensor's start in the buffer, the piece's [lo, hi) of the
        # flattened tensor, the piece's offset in this rank's slice)
        self.pieces = [
            [(n, s, start, lo, hi, at) for (n, s, lo, hi, at), start in _starts(lay, i) if takes_muon(n, s)]
            for lay, i in zip(layouts, indices)
        ]
        # a buffer holding a Muon tensor is gathered by every rank of its group, whichever part it holds
        self.gathered = [any(takes_muon(n, s) for n, s in zip(lay.names, lay.shapes)) for lay in layouts]
        self.bufs = [[torch.zeros(hi - lo, dtype=torch.float32) for *_, lo, hi, _at in ps] for ps in self.pieces]

    def intervals(self, k: int) -> list[tuple[int, int]]:
        """[start, stop) within buffer k's slice of each Muon piece (what AdamW leaves out)."""
        return [(at, at + hi - lo) for *_, lo, hi, at in self.pieces[k]]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], scale: float = 1.0) -> None:
        c = self.cfg
        for k, lay in enumerate(self.layouts):
            if not self.gathered[k]:
                continue
            mine = torch.zeros(lay.shard, dtype=torch.bfloat16, device=grads[k].device)
            for (*_, lo, hi, at), buf in zip(self.pieces[k], self.bufs[k]):
                g = grads[k][at : at + hi - lo].float()
                if scale != 1.0:
                    g = g * scale
                buf.lerp_(g, 1 - c.momentum)
                mine[at : at + hi - lo] = g.lerp(buf, c.momentum) if c.nesterov else buf
            full = self.gather(k, mine)
            for _name, shape, start, lo, hi, at in self.pieces[k]:
                whole = full[start : start + math.prod(shape)].view(shape)
                ortho = orthogonalized(whole, c.ns_steps).reshape(-1)[lo:hi]
                rows, cols = matrices("", shape)[0]
                m = self.masters[k][at : at + hi - lo]
                m.mul_(1 - c.muon_lr * c.muon_weight_decay)
                m.add_(ortho, alpha=-c.muon_lr * muon_lr_ratio(c.adjust_lr, rows, cols))

    def gather(self, k: int, mine: torch.Tensor) -> torch.Tensor:
        """Buffer k's update whole (padded,), from every rank's slice of it (`mine`: this rank's)."""
        group = self.groups[k]
        full = torch.empty(self.layouts[k].padded, dtype=mine.dtype, device=mine.device)
        if dist.get_world_size(group) > 1:
            dist.all_gather_into_tensor(full, mine, group=group)  # (shard,) x N -> (padded,)
        else:
            full.copy_(mine)
        return full

    def state_tensors(self) -> list[torch.Tensor]:
        return [b for bufs in self.bufs for b in bufs]


def _starts(layout, index):
    starts = {name: lo for name, _, lo, _ in layout.offsets()}
    return [(p, starts[p[0]]) for p in layout.pieces(index)]
