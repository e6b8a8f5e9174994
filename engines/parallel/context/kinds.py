"""Context parallelism's other kinds: K/V all-gathered (Llama 3) and the all-to-all to head shards
(DeepSpeed-Ulysses). Both keep the ring's zigzag layout (the ring, context/__init__.py: rank i holds chunks i and
2cp-1-i), so every rank does the same causal work and the model, the data and the theory's
activations are the same for every kind; only what crosses the cp group differs.

All-gather (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2; Megatron's
`--cp-comm-type all_gather`): each layer all-gathers K/V once, then the rank attends its queries to
every block it may see, the ring's schedule with every block at hand (the same block pairs and the
same log-sum-exp merges, so the same arithmetic as the ring). Backward gathers K/V again (only the
rank's own K/V are kept, as the ring keeps them) and reduce-scatters the dK/dV of every block to
its owner, in fp32 as the ring's accumulators travel. One collective instead of cp-1 hops, not
overlapped with compute: cheap when K/V are small (grouped-query attention, nkv << nh).

Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", section 3; Megatron's `--cp-comm-type a2a`):
an all-to-all turns (b, nh, s/cp, hd) sequence shards into (b, nh/cp, s, hd) head shards, dense
causal attention runs on the whole sequence for nh/cp heads, and the reverse all-to-all turns the
output back. The heads and the KV heads a tp rank holds must divide by cp (validation refuses
the rest: replicating KV heads would multiply the bytes sent by nh/nkv). Each all-to-all is its
own inverse's gradient, so backward sends the same bytes again.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from labkit.engines.layers import causal_attention, windowed_attention
from labkit.engines.parallel.common import all_gather_single, reduce_scatter_single
from labkit.engines.parallel.context import (
    Ring,
    _attend,
    _attend_grads,
    _gradients_of,
    _output,
    _queries,
    ring_schedule,
    zigzag_chunks,
    zigzag_index,
)
from labkit.engines.parallel.context.window import Windowed


class Gathered:
    """The cp group's all-gather attention for this rank: its schedule (the ring's, every block local)."""

    def __init__(self, group, rank: int, cp: int):
        self.group, self.rank, self.cp = group, rank, cp
        self.schedule = ring_schedule(rank, cp)

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        """(2, b, nkv, s/cp, hd) of this rank -> (cp, 2, b, nkv, s/cp, hd) of every rank."""
        out = kv.new_empty(self.cp * kv.numel())  # flat: gloo gathers along the first dim only
        all_gather_single(out, kv.contiguous().view(-1), group=self.group)
        return out.view(self.cp, *kv.shape)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (b, nh, s/cp, hd), k and v (b, nkv, s/cp, hd) -> (b, nh, s/cp, hd), as layers.causal_attention."""
        return _GatheredAttention.apply(q, k, v, self)


class _GatheredAttention(torch.autograd.Function):
    """Forward: K/V gathered, the ring's block pairs merged by log-sum-exp.
    Backward: K/V gathered again, every block's dK/dV reduce-scattered home."""

    @staticmethod
    def forward(ctx, q, k, v, att: Gathered):
        acc, scale, g, qh, out, lse = _queries(q, k, 2)
        every = att.gather(torch.stack([k, v]))  # (cp, 2, b, nkv, s/cp, hd)
        for t, pairs in enumerate(att.schedule):
            # the block the ring would hold at step t
            _attend(qh, out, lse, every[(att.rank - t) % att.cp], pairs, g, acc, scale)
        del every  # the gathered K/V are not kept: backward gathers them again
        y, lse = _output(out, lse, q)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.att, ctx.scale = att, scale
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        att, scale = ctx.att, ctx.scale
        acc, *grads = _gradients_of(q, k, y, lse, dy, 2)
        every = att.gather(torch.stack([k, v]))  # (cp, 2, b, nkv, s/cp, hd)
        # dK/dV of every rank's block, in fp32 like the ring's travelling accumulators
        dkv = torch.zeros(every.shape, dtype=acc, device=q.device)  # (cp, 2, b, nkv, s/cp, hd)
        for t, pairs in enumerate(att.schedule):
            holder = (att.rank - t) % att.cp
            dk, dv = dkv[holder, 0].chunk(2, dim=2), dkv[holder, 1].chunk(2, dim=2)  # views into dkv
            _attend_grads(grads, every[holder], dk, dv, pairs, acc, scale)
        own = dkv.new_empty(dkv.shape[1:])  # (2, b, nkv, s/cp, hd): the sum over ranks of this rank's block
        reduce_scatter_single(own.view(-1), dkv.view(-1), group=att.group)
        return torch.cat(grads[-1], dim=2).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None


class _SeqToHeads(torch.autograd.Function):
    """(p, b, n, s/cp, hd) sequence shards -> (p, b, n/cp, s, hd) head shards, the s positions in
    order (p stacks tensors that travel in one message: K and V). Backward: the reverse all-to-all.
    The reordering happens inside, so autograd keeps no index tensor."""

    @staticmethod
    def forward(ctx, x, ulysses: Ulysses):
        ctx.ulysses = ulysses
        return _reorder(_to_heads(x, ulysses.group, ulysses.cp), ulysses.natural)

    @staticmethod
    def backward(ctx, dx):
        u = ctx.ulysses
        return _to_seq(_reorder(dx, u.back), u.group, u.cp), None


class _HeadsToSeq(torch.autograd.Function):
    """The inverse of _SeqToHeads: (p, b, n/cp, s, hd) in position order -> (p, b, n, s/cp, hd)."""

    @staticmethod
    def forward(ctx, x, ulysses: Ulysses):
        ctx.ulysses = ulysses
        return _to_seq(_reorder(x, ulysses.back), ulysses.group, ulysses.cp)

    @staticmethod
    def backward(ctx, dx):
        u = ctx.ulysses
        return _reorder(_to_heads(dx, u.group, u.cp), u.natural), None


def _reorder(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """(p, b, n, s, hd) with its s rows in `index`'s order (None: as they are)."""
    return x if index is None else x[:, :, :, index.to(x.device)].contiguous()


def _to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(p, b, n, s/cp, hd) -> (p, b, n/cp, s, hd), the s rows in rank order (rank 0's tokens first)."""
    p, b, n, sl, hd = x.shape
    # head group j goes to cp rank j: -> (cp, p, b, n/cp, s/cp, hd)
    send = x.reshape(p, b, cp, n // cp, sl, hd).permute(2, 0, 1, 3, 4, 5).contiguous()
    recv = torch.empty_like(send)  # recv[r]: rank r's tokens of this rank's heads
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 3, 0, 4, 5).reshape(p, b, n // cp, cp * sl, hd)


def _to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(p, b, n/cp, s, hd), rows in rank order -> (p, b, n, s/cp, hd)."""
    p, b, m, s, hd = x.shape
    # the tokens of cp rank r go back to it: -> (cp, p, b, n/cp, s/cp, hd)
    send = x.reshape(p, b, m, cp, s // cp, hd).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)  # recv[j]: head group j of this rank's tokens
    dist.all_to_all_single(recv, send, group=group)
    # laid out (p, b, s/cp, n, hd) as the ring lays its output, so the caller's
    # transpose(1, 2).reshape(b, s/cp, h) is a view, not a copy
    out = recv.permute(1, 2, 4, 0, 3, 5).contiguous().view(p, b, s // cp, cp * m, hd)
    return out.transpose(2, 3)


class Ulysses:
    """The cp group's all-to-all attention: sequence shards to head shards, dense causal attention
    over the whole sequence, and back."""

    def __init__(self, group, rank: int, cp: int, seq: int, window: int | None = None):
        self.group, self.rank, self.cp = group, rank, cp
        # a local layer's (Gemma 3): the same all-to-alls, the window applied on the whole sequence
        self.attend = causal_attention if window is None else partial(windowed_attention, window=window)
        arrived = torch.cat([zigzag_index(seq, cp, r) for r in range(cp)])  # the position of each row after the a2a
        self.natural = arrived.argsort()  # rows in position order
        self.back = self.natural.argsort()  # position order back to rank order

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (b, nh, s/cp, hd), k and v (b, nkv, s/cp, hd) -> (b, nh, s/cp, hd), as layers.causal_attention."""
        q = _SeqToHeads.apply(q.unsqueeze(0), self)[0]  # (b, nh/cp, s, hd)
        k, v = _SeqToHeads.apply(torch.stack([k, v]), self)  # K and V in one message: 2 x (b, nkv/cp, s, hd)
        y = self.attend(q, k, v)  # (b, nh/cp, s, hd): dense, over every position
        return _HeadsToSeq.apply(y.unsqueeze(0), self)[0]


class Hierarchical:
    """Both levels (Megatron's --cp-comm-type a2a+p2p): the Ulysses all-to-all inside this rank's
    run of a = cp_a2a consecutive cp ranks, so each rank holds the run's 2a zigzag chunks for nh/a
    heads; then ring attention across the cp/a runs, each ring member holding its run's chunks
    (the ring of context/__init__.py with 2a chunks a member: the pairs stay balanced, 2a² blocks a step, as a
    run's chunks are a zigzag of width a); then the all-to-all back. The all-to-all stays on the
    fast link (a node), only the ring's overlapped hops cross the slow one."""

    def __init__(self, inner, outer, cp: int, a: int, rank: int):
        self.group, self.cp = inner, a  # the all-to-all's group and size (_SeqToHeads reads these)
        self.natural = self.back = None  # the ring takes the run's tokens as they arrive, rank by rank
        run = lambda r: [c for j in range(a) for c in zigzag_chunks(r * a + j, cp)]  # noqa: E731
        self.ring = Ring(outer, rank // a, cp // a, run)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (b, nh, s/cp, hd), k and v (b, nkv, s/cp, hd) -> (b, nh, s/cp, hd), as layers.causal_attention."""
        q = _SeqToHeads.apply(q.unsqueeze(0), self)[0]  # (b, nh/a, a·s/cp, hd): the run's tokens
        k, v = _SeqToHeads.apply(torch.stack([k, v]), self)  # 2 x (b, nkv/a, a·s/cp, hd)
        y = self.ring(q, k, v)  # the runs' K/V round the ring
        return _HeadsToSeq.apply(y.unsqueeze(0), self)[0]


def apply_cp(model: torch.nn.Module, mesh, kind, cfg_a2a: int = 1) -> tuple[torch.nn.Module, dict]:
    """Swap every block's attention kernel for the cp group's attention of `kind` (ParallelConfig.context:
    the ring, K/V all-gathered, Ulysses' all-to-all, or hierarchical over runs of `cfg_a2a`); tell
    per-sequence statistics (the MoE router's balance loss) that a sequence spans the cp group.
    Returns (model, this rank's chunks and the zigzag's block pairs per step as data for the report); `zigzag_inputs`
    gives the tokens it must be fed."""
    cp, rank = mesh.size("cp"), mesh.coord("cp")
    group = mesh.group("cp")
    if kind.hierarchical:
        a = cfg_a2a
        core = Hierarchical(mesh.run_group("cp", a), mesh.stride_group("cp", a), cp, a, rank)
    elif kind.ring:
        core = Ring(group, rank, cp)
    elif kind.gathers:
        core = Gathered(group, rank, cp)
    else:
        core = Ulysses(group, rank, cp, model.cfg.seq)
    local = {}  # a sliding window's core, one per width (Gemma 3's local layers)
    for block in model.blocks:
        w = block.attn.window
        if getattr(block.attn, "sinks", None) is not None:  # GPT-OSS (the ring only: config/model_problems.py)
            kernel = core if w is None else local.setdefault(w, Windowed(group, rank, cp, model.cfg.seq, w))
            block.attn.core = partial(kernel, sinks=block.attn.sinks)
        elif w is None:
            block.attn.core = core
        elif kind.splits_heads:  # Ulysses: whole heads over the whole sequence, the window in its dense attention
            block.attn.core = local.setdefault(w, Ulysses(group, rank, cp, model.cfg.seq, window=w))
        else:  # ring and all-gather alike: the rows inside the window, point to point (context/window.py)
            block.attn.core = local.setdefault(w, Windowed(group, rank, cp, model.cfg.seq, w))
    for m in model.modules():
        if hasattr(m, "seq_split"):
            m.seq_split = (group, cp)
    return model, {"cp_chunks": list(zigzag_chunks(rank, cp)), "ring_schedule": ring_schedule(rank, cp)}
