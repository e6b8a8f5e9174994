"""Compute orders: the F / B / W actions of one pipeline rank, in the order it runs them, for every
schedule labkit knows. Pure Python; schedules.py adds the sends and receives and checks them.

An order is a list of (op, microbatch, chunk). B is the whole backward of a schedule that does
not split it; in one that does (a W follows every B), B computes the input gradient and W the
weight gradients (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2). Where
a published schedule runs a backward whole, the split one runs its B and W back to back.

Chunk c of rank r holds virtual stage c·p + r ('loop': GPipe, 1F1B, interleaved, ZB-H1) or, for
the V-shaped schedules (ZB-V, DualPipeV), stage r for c = 0 and 2p - 1 - r for c = 1.
"""

from __future__ import annotations


def gpipe_order(p: int, m: int, rank: int) -> list[tuple]:
    """GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards (in microbatch order,
    as torch's ScheduleGPipe). Every microbatch's activations are in flight at once."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple]:
    """1F1B / PipeDream-Flush (Narayanan et al., SC 2021, section 2.1): warm up with p-rank-1
    forwards, then alternate one forward and one backward, then drain the backwards. The same
    bubble as GPipe, but at most p - rank microbatches in flight."""
    warm = min(p - rank - 1, m)
    order = [("F", i, 0) for i in range(warm)]  # warmup
    for i in range(m - warm):  # steady state
        order += [("F", warm + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warm, m)]  # cooldown
    return order


def _interleaved_id(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) on a rank, as Megatron's
    get_model_chunk_id: groups of p microbatches visit the chunks in turn."""
    chunk = (k // p) % v
    mb = (k // (p * v)) * p + k % p
    return mb, (chunk if forward else v - 1 - chunk)


def interleaved_order(p: int, m: int, v: int, rank: int) -> list[tuple]:
    """Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2; Megatron-LM's
    forward_backward_pipelining_with_interleaving): v chunks per rank, microbatches taken in
    groups of p; warmup (p - rank - 1)·2 + (v - 1)·p forwards, then 1F1B, then cooldown.
    The bubble shrinks by v: (p-1)/(v·m + p-1). Needs m % p == 0."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({p})")
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    f = [("F", *_interleaved_id(k, p, v, True)) for k in range(total)]
    b = [("B", *_interleaved_id(k, p, v, False)) for k in range(total)]
    order = f[:warm]
    for k in range(total - warm):
        order += [f[warm + k], b[k]]
    return order + b[total - warm :]


def zbh1_order(p: int, m: int, rank: int) -> list[tuple]:
    """ZB-H1 (Qi et al., ICLR 2024, section 2.1): 1F1B with each backward split into B (input
    gradient, on the critical path) and W (weight gradient, free to move). Rank r runs its W's r
    slots late, so the last ranks send their B's upstream without waiting for their W's, and the
    W's fill the cooldown. At most min(m, p) microbatches in flight on any rank (1F1B's peak, on
    rank 0). With t_F = t_B = t_W and m >= p the step takes 3m + p - 1 units: the bubble
    (p-1)(t_F + t_B - t_W) of the paper's table 2, a third of 1F1B's (p-1)(t_F + t_B + t_W)."""
    warm = min(p - rank - 1, m)
    order = [("F", i, 0) for i in range(warm)]
    w = 0
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
        if i >= rank:  # W of an older microbatch, `rank` slots late
            order.append(("W", w, 0))
            w += 1
    for i in range(m - warm, m):  # cooldown: each B, then the oldest W pending
        order += [("B", i, 0), ("W", w, 0)]
        w += 1
    return order + [("W", i, 0) for i in range(w, m)]


def zbv_order(p: int, m: int, rank: int) -> list[tuple]:
    """ZB-V (Qi et al., ICLR 2024, section 6; torch.distributed.pipelining's ScheduleZBVZeroBubble,
    whose order this is): two chunks per rank in a V (chunk 0 is stage r, chunk 1 stage 2p-1-r,
    so rank 0 holds both ends), each backward split. Warm up with 2(p-r)-1 forwards of chunk 0,
    then r pairs F1 F0, then p-r rounds of F1 B1 W1; the steady state runs F0 B0 W0 F1 B1 W1;
    the cooldown runs the B's first and the W's last. Torch builds it for max(m, 2p-1)
    microbatches and drops the ones beyond m; so does this."""
    n = max(2 * p - 1, m)
    order: list[tuple] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        order.append(("F", f0, 0))
        f0 += 1
    for _ in range(rank):
        order += [("F", f1, 1), ("F", f0, 0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(p - rank):
        order += [("F", f1, 1), ("B", b1, 1), ("W", b1, 1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:  # steady state
        if f0 < n:
            order.append(("F", f0, 0))
            f0 += 1
        order += [("B", b0, 0), ("W", b0, 0), ("F", f1, 1), ("B", b1, 1), ("W", b1, 1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):  # cooldown
        order += [("B", b0, 0), ("B", b1, 1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        order += [("B", b0, 0), ("W", w0, 0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [("W", i, 1) for i in range(w1, b1)] + [("W", i, 0) for i in range(w0, b0)]
    return [a for a in order if a[1] < m]


def dualpipev_order(p: int, m: int, rank: int) -> list[tuple]:
    """DualPipeV: DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1) cut
    in half into a V, two chunks per rank (deepseek-ai/DualPipe's dualpipev.py; this is the order
    of torch.distributed.pipelining's ScheduleDualPipeV). Its steady state pairs the forward of
    one chunk with the whole backward of the other (DualPipe overlaps the pair's computation
    with its communication on GPUs; here the pair runs one after the other, F then B then W).
    Backwards run whole (B, W) except in the zero-bubble phases (steps 3 and the second half of
    6), whose W's wait in a queue for steps 7 and 8. Needs m >= 2p (one microbatch per stage)."""
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs microbatches ({m}) >= 2 * pp ({2 * p}), one per stage")
    order: list[tuple] = []
    count = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0}
    waiting: list[tuple] = []  # (mb, chunk) whose W is deferred

    def forward(c):
        order.append(("F", count["F", c], c))
        count["F", c] += 1

    def backward(c, whole=True):
        mb = count["B", c]
        order.append(("B", mb, c))
        if whole:
            order.append(("W", mb, c))
        else:
            waiting.append((mb, c))
        count["B", c] += 1

    def deferred_w():
        if waiting:
            mb, c = waiting.pop(0)
            order.append(("W", mb, c))

    for _ in range((p - rank - 1) * 2):  # 1: F0
        forward(0)
    for _ in range(rank + 1):  # 2: F0 F1
        forward(0)
        forward(1)
    for _ in range(p - rank - 1):  # 3: B1 W F1 (zero bubble)
        backward(1, whole=False)
        deferred_w()
        forward(1)
    for _ in range(m - 2 * p + rank + 1):  # 4: the main step, F0 with B1, then F1 with B0
        forward(0)  # (for rank p-1's first pair torch does not overlap them either)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - rank - 1):  # 5: B1, then F1 with B0
        backward(1)
        forward(1)
        backward(0)
    split = False
    for i in range(rank + 1):  # 6: B1 B0, the second half split (zero bubble)
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        backward(1, whole=not split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        backward(0, whole=not split)
    for _ in range(p - rank - 1):  # 7: W B0
        deferred_w()
        backward(0, whole=not split)
    for _ in range(rank + 1):  # 8: the W's left
        deferred_w()
    return order
