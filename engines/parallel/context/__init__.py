"""Context parallelism: ring attention over the cp ranks, zigzag load balancing (the other kinds,
all-gather and Ulysses, and the choice among them: context/kinds.py).

Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023): the sequence is split over the cp ranks; each keeps its query block while the key/value
blocks travel round the ring, one hop per step, the next hop in flight while the rank attends
to the block it holds. Partial results merge by the log-sum-exp rule (the online softmax of
Milakov & Gimelshein 2018, as FlashAttention rescales): for two partial results (o1, l1), (o2, l2)
of the same queries,  l = log(e^l1 + e^l2),  o = o1 e^(l1-l) + o2 e^(l2-l).

Causal load balance (zigzag). With contiguous blocks the last rank's queries see every key and
the first rank's only its own (the imbalance Brandon et al. 2023, "Striped Attention", measure
and fix by striping tokens). Cut the sequence into 2cp chunks and give rank i chunks i and
2cp-1-i, the layout of Megatron-LM's context parallelism and of Llama 3 (Dubey et al. 2024,
section 3.3.2): at every step each rank computes the same work, two (chunk x chunk) blocks'
worth, so no rank waits for another. `ring_schedule` is that schedule as data; the forward and
the backward both execute it.

Backward (hand-written, FlashAttention-2's algorithm 2 per block pair, Dao 2023): the queries'
global log-sum-exp and delta = rowsum(dO * O) are known locally, so each block's gradients are
exact on their own; the K/V blocks go round the ring again and each block's dK/dV accumulator
travels behind it, hop by hop, until it arrives back at the block's owner.

Grouped-query attention: the ring carries the nkv KV heads (the message shrinks by nh/nkv) and
each rank expands the block it holds to the query heads. Rotary positions need nothing here:
the model rotates q and k before attention by each token's own position, and a rank's positions
are its zigzag chunks' (`zigzag_inputs` hands them to the model with the tokens).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.engines.p2p import Link

# K/V and dK/dV messages travel the same link at once: gloo keeps them apart by tag; NCCL
# ignores tags and matches them by order, which is the same on every rank (K/V hop t, then dK/dV hop t)
KV_TAG, DKV_TAG = 0, 1


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two of the 2cp sequence chunks that cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of this rank's tokens, in local order: chunk i, then chunk 2cp-1-i.
    (s,) -> (s/cp,) int64."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(k * c, (k + 1) * c) for k in zigzag_chunks(rank, cp)])


def block_pairs(mine: list[int], theirs: list[int]) -> list[tuple[int, int, str]]:
    """(query chunk, key chunk, 'causal' | 'full') by their places in `mine` and `theirs` (global
    chunk numbers) for every pair whose keys the queries may see: the diagonal chunk under a
    causal mask, earlier chunks in full, later ones not at all."""
    return [
        (qa, kb, "causal" if kc == qc else "full")
        for qa, qc in enumerate(mine)
        for kb, kc in enumerate(theirs)
        if kc <= qc
    ]


def ring_schedule(rank: int, cp: int, chunks_of=None) -> list[list[tuple[int, int, str]]]:
    """What ring member `rank` of `cp` computes at each ring step t (it then holds the K/V of
    member (rank - t) % cp): block_pairs of its chunks and the holder's. `chunks_of(member)` lists
    a member's chunks in the order its tokens sit (default: the zigzag, two per rank)."""
    chunks_of = chunks_of or (lambda r: zigzag_chunks(r, cp))
    return [block_pairs(chunks_of(rank), chunks_of((rank - t) % cp)) for t in range(cp)]


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale  # (b, nh, c, hd) @ (b, nh, hd, c) -> (b, nh, c, c)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _expand(x: torch.Tensor, g: int) -> torch.Tensor:
    """KV heads to query heads (grouped-query attention): (b, nkv, c, hd) -> (b, nkv·g, c, hd),
    query head i reading KV head i // g. Only the received block is expanded: the ring carries
    the nkv heads."""
    if g == 1:
        return x
    b, n, c, d = x.shape
    return x[:, :, None].expand(b, n, g, c, d).reshape(b, n * g, c, d)


def _fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """The gradient of `_expand`: (b, nkv·g, c, hd) -> (b, nkv, c, hd), summed over each group."""
    if g == 1:
        return x
    b, n, c, d = x.shape
    return x.view(b, n // g, g, c, d).sum(dim=2)


def _block(q, k, v, causal: bool, scale: float):
    """Softmax attention of one chunk pair: out (b, nh, c, hd) and its log-sum-exp (b, nh, c)."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (b, nh, c)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse  # (b, nh, c, c) @ (b, nh, c, hd)


def _merge(out, lse, o, l):
    """Online-softmax merge of a partial result (o, l) into (out, lse), same queries."""
    new = torch.logaddexp(lse, l)  # (b, nh, c)
    return out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(l - new).unsqueeze(-1), new


def _block_grads(q, k, v, do, lse, delta, causal: bool, scale: float):
    """One chunk pair's gradients from the queries' global lse and delta (FlashAttention-2, alg. 2):
    P = exp(S - lse); dV = P^T dO; dP = dO V^T; dS = P (dP - delta); dQ = dS K s; dK = dS^T Q s."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))  # (b, nh, c, c)
    dv = p.transpose(-2, -1) @ do  # (b, nh, c, hd)
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))  # (b, nh, c, c)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv  # dq, dk, dv


class Ring:
    """The cp ring of this rank: its schedule and point-to-point hops to the next / from the previous rank."""

    def __init__(self, group, rank: int, cp: int, chunks_of=None):
        self.group, self.rank, self.cp = group, rank, cp
        self.schedule = ring_schedule(rank, cp, chunks_of)
        # the chunks each member's tokens are cut into: the zigzag's two, or a hierarchical run's 2·cp_a2a
        self.n_chunks = len(chunks_of(rank)) if chunks_of else 2
        self.next, self.prev = (rank + 1) % cp, (rank - 1) % cp
        self.link = Link(group)
        self._next_global = dist.get_global_rank(group, self.next)
        self._prev_global = dist.get_global_rank(group, self.prev)

    def hop(self, send: torch.Tensor, tag: int):
        """Start sending `send` to the next rank and receiving its like from the previous one, as
        one batch (engines/p2p.py: under NCCL two unbatched ops would wait on each other);
        returns (received buffer, works to wait on)."""
        recv = torch.empty_like(send)
        hop = self.link.batch([(send, self._next_global, tag)], [(recv, self._prev_global, tag)])
        return recv, [hop]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks=None) -> torch.Tensor:
        """Causal attention of this rank's zigzag tokens against the whole sequence.
        q (b, nh, s/cp, hd), k and v (b, nkv, s/cp, hd) -> (b, nh, s/cp, hd), the same contract as
        layers.causal_attention. `sinks` (nh,): GPT-OSS's, joined once per query after the merge."""
        return _RingAttention.apply(q, k, v, self, sinks)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _queries(q: torch.Tensor, k: torch.Tensor, n: int):
    """What every kind's forward starts from: (acc dtype, scale, query heads per KV head, q in n
    chunks in acc, the running outputs and log-sum-exps, one per chunk)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.to(acc).chunk(n, dim=2)  # n x (b, nh, c, hd)
    out = [torch.zeros_like(x) for x in qh]
    lse = [torch.full(x.shape[:-1], float("-inf"), dtype=acc, device=q.device) for x in qh]
    return acc, 1.0 / math.sqrt(q.shape[-1]), q.shape[1] // k.shape[1], qh, out, lse


def _attend(qh, out, lse, kv: torch.Tensor, pairs, g: int, acc, scale: float) -> None:
    """Merge the block pairs of one held K/V block (2, b, nkv, s/cp, hd) into out and lse, in place."""
    n = len(qh)
    kh = [_expand(x, g) for x in kv[0].to(acc).chunk(n, dim=2)]  # n x (b, nh, c, hd)
    vh = [_expand(x, g) for x in kv[1].to(acc).chunk(n, dim=2)]
    for qa, kb, mask in pairs:
        o, l = _block(qh[qa], kh[kb], vh[kb], mask == "causal", scale)
        out[qa], lse[qa] = _merge(out[qa], lse[qa], o, l)


def _output(out, lse, q: torch.Tensor):
    """(y, lse) from the merged chunks: y laid out (b, s/cp, nh, hd) like PyTorch's CPU flash
    attention, so the caller's transpose(1, 2).reshape(b, s/cp, h) is a view, not a copy."""
    y = torch.cat(out, dim=2).transpose(1, 2).to(q.dtype).contiguous().transpose(1, 2)
    return y, torch.cat(lse, dim=2)  # lse (b, nh, s/cp)


def _gradients_of(q, k, y, lse, dy, n: int):
    """What every kind's backward starts from: (acc dtype, query heads per KV head, then q, dO, lse
    and delta = rowsum(dO * O) in n chunks, and dq's accumulators)."""
    acc = lse.dtype
    do = dy.to(acc)
    delta = (do * y.to(acc)).sum(-1)  # (b, nh, s/cp)
    qh, doh = q.to(acc).chunk(n, dim=2), do.chunk(n, dim=2)
    lseh, deltah = lse.chunk(n, dim=2), delta.chunk(n, dim=2)
    return acc, q.shape[1] // k.shape[1], qh, doh, lseh, deltah, [torch.zeros_like(x) for x in qh]


def _attend_grads(grads, kv: torch.Tensor, dk, dv, pairs, acc, scale: float) -> None:
    """The block pairs' gradients against one held K/V block: dq, and this block's dk, dv chunks
    (n x (b, nkv, c, hd)), accumulated in place. `grads` is _gradients_of's tuple less acc."""
    g, qh, doh, lseh, deltah, dq = grads
    n = len(qh)
    kh = [_expand(x, g) for x in kv[0].to(acc).chunk(n, dim=2)]  # n x (b, nh, c, hd)
    vh = [_expand(x, g) for x in kv[1].to(acc).chunk(n, dim=2)]
    for qa, kb, mask in pairs:
        gq, gk, gv = _block_grads(qh[qa], kh[kb], vh[kb], doh[qa], lseh[qa], deltah[qa], mask == "causal", scale)
        dq[qa] += gq
        dk[kb].add_(_fold(gk, g))  # in place: the caller's chunks may be views of one buffer
        dv[kb].add_(_fold(gv, g))


class _RingAttention(torch.autograd.Function):
    """Forward: K/V round the ring, partial results merged by log-sum-exp.
    Backward: K/V round the ring again, each block's dK/dV accumulator following it home."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, sinks=None):
        acc, scale, g, qh, out, lse = _queries(q, k, ring.n_chunks)
        kv = torch.stack([k, v])  # (2, b, nkv, s/cp, hd): one message per hop
        for t, pairs in enumerate(ring.schedule):
            nxt, works = ring.hop(kv, KV_TAG) if t < ring.cp - 1 else (None, [])
            _attend(qh, out, lse, kv, pairs, g, acc, scale)
            _wait(works)
            kv = nxt
        if sinks is not None:  # once per query, after every block is merged (engines/sinks.py): L' = L ⊕ sink
            for i in range(len(out)):
                joined = torch.logaddexp(lse[i], sinks.to(acc).view(1, -1, 1))  # (b, nh, c)
                out[i], lse[i] = out[i] * torch.exp(lse[i] - joined).unsqueeze(-1), joined
        y, lse = _output(out, lse, q)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.ring, ctx.scale, ctx.sinks = ring, scale, sinks
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        acc, *grads = _gradients_of(q, k, y, lse, dy, ring.n_chunks)
        kv = torch.stack([k, v])  # (2, b, nkv, s/cp, hd)
        own = None  # this rank's part of its own dK/dV
        incoming, pending, sent = None, [], []
        for t, pairs in enumerate(ring.schedule):
            nxt, works = ring.hop(kv, KV_TAG) if t < ring.cp - 1 else (None, [])
            dk = [torch.zeros_like(x) for x in kv[0].to(acc).chunk(ring.n_chunks, dim=2)]  # n x (b, nkv, c, hd)
            dv = [torch.zeros_like(x) for x in dk]
            _attend_grads(grads, kv, dk, dv, pairs, acc, scale)
            dkv = torch.stack([torch.cat(dk, dim=2), torch.cat(dv, dim=2)])  # (2, b, nkv, s/cp, hd)
            if t == 0:
                own = dkv
            else:
                if incoming is not None:  # the accumulator of the block held now
                    _wait(pending)
                    dkv = dkv + incoming
                incoming, pending = ring.hop(dkv, DKV_TAG)  # on to the next holder (last hop: home)
                sent.append(dkv)
            _wait(works)
            kv = nxt
        if incoming is not None:
            _wait(pending)
            own = own + incoming  # everyone else's part, back home
        dq = torch.cat(grads[-1], dim=2).to(q.dtype)
        dsinks = None
        if ctx.sinks is not None:  # -Σ_rows P'(sink) · rowsum(dO · y) over this rank's queries; cp sums the rest
            sinks = ctx.sinks
            share = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)  # (b, nh, s/cp)
            dsinks = -(share * (dy.to(acc) * y.to(acc)).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, dsinks


def zigzag_inputs(seq: int, mesh):
    """The `RankModel.inputs` map under context parallelism: this cp rank's zigzag tokens,
    targets and their positions."""
    index = zigzag_index(seq, mesh.size("cp"), mesh.coord("cp"))

    def inputs(tokens: torch.Tensor, targets: torch.Tensor):
        idx = index.to(tokens.device)
        return tokens[:, idx], targets[:, idx], idx  # (b, s) -> (b, s/cp), positions (s/cp,)

    return inputs
