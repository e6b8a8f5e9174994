"""Sliding-window attention on a context-parallel rank: the K/V rows inside the window
come point to point from the ranks that hold them (labkit/layout/window.py `window_plan`, the same
plan the theory prices), each of this rank's zigzag chunks attends to its own rows and those, and
the received rows' gradients go back to their owners in backward. Blocks outside the window are
neither computed nor sent. Used for every local layer (ModelConfig.layer_window) whatever the
cp_kind of the global layers, except Ulysses, whose all-to-all hands each rank whole heads over
the whole sequence: it applies the window in its dense attention (context/kinds.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.engines.layers import window_mask
from labkit.engines.p2p import Link
from labkit.engines.sinks import sink_flash
from labkit.layout.window import local_start, window_plan

# beside the ring's K/V (0) and dK/dV (1) tags: gloo matches messages by tag; NCCL by order, the same on every rank
ROWS_TAG, GRADS_TAG = 2, 3


def _index(spans, c: int, cp: int) -> torch.Tensor:
    """Local row numbers (in the owner's zigzag order) of the rows `spans` names."""
    return torch.cat([torch.arange(lo, hi) + local_start(kc, cp) * c for kc, lo, hi in spans])


class Windowed:
    """This cp rank's attention for one sliding window: the exchange plan and the local chunks' key lists."""

    def __init__(self, group, rank: int, cp: int, seq: int, window: int):
        self.cp, self.window, self.c = cp, window, seq // (2 * cp)
        plan = window_plan(seq, cp, window)[rank]
        glob = lambda peer: dist.get_global_rank(group, peer)  # noqa: E731
        self.link = Link(group)
        self.sends = [(glob(p), _index(s, self.c, cp)) for p, s in plan["send"].items()]
        self.recvs = [(glob(p), s) for p, s in plan["recv"].items()]
        # per query chunk (local order): the pieces of its keys, ('own' | received message i, rows), ascending
        self.chunks = []
        for qc in (rank, 2 * cp - 1 - rank):
            first = max(0, qc * self.c - (window - 1))
            pieces = []
            for kc in range(first // self.c, qc + 1):
                lo = max(first, kc * self.c) - kc * self.c
                if kc in (rank, 2 * cp - 1 - rank):  # its own chunk
                    start = local_start(kc, cp) * self.c
                    pieces.append(("own", slice(start + lo, start + self.c), kc * self.c + lo))
                    continue
                for i, (_, spans) in enumerate(self.recvs):
                    offset = 0
                    for k, a, b in spans:
                        if k == kc:  # its rows lo.. of the message's [a, b)
                            pieces.append((i, slice(offset + lo - a, offset + b - a), kc * self.c + lo))
                        offset += b - a
            self.chunks.append((qc * self.c, pieces))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks=None) -> torch.Tensor:
        """q (b, nh, s/cp, hd), k and v (b, nkv, s/cp, hd) -> (b, nh, s/cp, hd), as layers.causal_attention.
        `sinks` (nh,): GPT-OSS's; a chunk holds every key its queries see, so each query counts its sink once."""
        kv = torch.stack([k, v])  # (2, b, nkv, s/cp, hd): one message per peer
        got = _Exchange.apply(kv, self) if self.recvs or self.sends else ()
        out = []
        for n, (start, pieces) in enumerate(self.chunks):
            keys = [(kv if src == "own" else got[src])[:, :, :, rows] for src, rows, _ in pieces]
            pos = torch.cat([torch.arange(p0, p0 + r.stop - r.start) for _, r, p0 in pieces]).to(q.device)
            kc = torch.cat(keys, dim=3)  # (2, b, nkv, keys, hd): this chunk's keys, inside its window and before
            qpos = torch.arange(start, start + self.c, device=q.device)
            mask = window_mask(qpos, pos, self.window)  # (c, keys)
            qn = q[:, :, n * self.c : (n + 1) * self.c]
            gqa = k.shape[1] != q.shape[1]
            if sinks is not None:
                out.append(sink_flash(qn, kc[0], kc[1], sinks, mask))
                continue
            out.append(F.scaled_dot_product_attention(qn, kc[0], kc[1], attn_mask=mask, enable_gqa=gqa))
        return torch.cat(out, dim=2)  # (b, nh, s/cp, hd)


class _Exchange(torch.autograd.Function):
    """Forward: this rank's rows inside its peers' windows out, theirs in (one batch of sends and
    receives). Backward: the gradients of the received rows back to their owners, and those of the
    rows it sent added into its own K/V's gradient."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, w: Windowed):
        sends = [(kv[:, :, :, idx.to(kv.device)].contiguous(), peer, ROWS_TAG) for peer, idx in w.sends]
        shape = lambda n: (*kv.shape[:3], n, kv.shape[4])  # noqa: E731
        recvs = [(kv.new_empty(shape(sum(b - a for _, a, b in s))), peer, ROWS_TAG) for peer, s in w.recvs]
        w.link.batch(sends, recvs).wait()
        ctx.w, ctx.shape = w, kv.shape
        return tuple(buf for buf, _, _ in recvs)

    @staticmethod
    def backward(ctx, *grads):
        # every received buffer is some chunk's keys, so every rank runs this backward (its peers wait
        # on it); autograd hands zeros, not None, for an unused output (materialized grads)
        w = ctx.w
        back = [(g.contiguous(), peer, GRADS_TAG) for g, (peer, _) in zip(grads, w.recvs)]
        dkv = grads[0].new_zeros(ctx.shape)  # (2, b, nkv, s/cp, hd)
        shape = lambda n: (*ctx.shape[:3], n, ctx.shape[4])  # noqa: E731
        incoming = [(dkv.new_empty(shape(len(idx))), peer, GRADS_TAG) for peer, idx in w.sends]
        w.link.batch(back, incoming).wait()
        for (buf, _, _), (_, idx) in zip(incoming, w.sends):
            dkv[:, :, :, idx.to(dkv.device)] += buf
        return dkv, None
