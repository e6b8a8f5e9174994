"""Sliding-window attention under context parallelism, as data: which K/V rows each cp rank needs
from which other rank (engines/parallel/context/window.py executes it, the theory prices it:
labkit/theory/exact/context.py).

The zigzag layout stays (engines/parallel/context/: rank r holds chunks r and 2cp-1-r of c = s/2cp
tokens each), so a model mixing local and global layers (Gemma 3) keeps one token layout. A query
at position i of a local layer sees the keys i - window < j <= i (transformers' sliding_window_overlay),
so chunk q needs only the last window-1 positions before it: the tails of the chunks just below it,
ceil((window-1)/c) of them at most. Those rows, and no others, go point to point from their owner
to the rank that needs them (its K and V in one message per peer), and their gradients come back
the same way in backward; blocks outside the window are neither computed nor sent. A ring would
pass every block through every rank (cp-1 hops): under the zigzag, chunk 2cp-1-r needs its
neighbour chunk 2cp-2-r, which sits on rank r+1, the ring's last hop away. With window-1 <= c each
rank sends at most two tails of window-1 rows (2(window-1)/s of a ring's K/V traffic at cp=2·s/2c).
"""

from __future__ import annotations

from functools import lru_cache


def chunk_owner(chunk: int, cp: int) -> int:
    """The cp rank holding zigzag chunk `chunk` (chunks i and 2cp-1-i are rank i's)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def zigzag_positions(seq: int, cp: int, rank: int) -> list[int]:
    """The sequence positions cp rank `rank` holds, in its local order: chunk rank, then chunk 2cp-1-rank
    (engines/parallel/context/ `zigzag_index`, the same as a tensor)."""
    c = seq // (2 * cp)
    return [i for k in (rank, 2 * cp - 1 - rank) for i in range(k * c, (k + 1) * c)]


def local_start(chunk: int, cp: int) -> int:
    """Where chunk `chunk` starts in its owner's local rows, in chunks (0: its first, 1: its second)."""
    return 0 if chunk < cp else 1


@lru_cache(maxsize=256)
def window_plan(seq: int, cp: int, window: int) -> tuple[dict, ...]:
    """Per cp rank: {'recv': {peer: ((chunk, lo, hi), ...)}, 'send': {peer: ((chunk, lo, hi), ...)}}:
    rows [lo, hi) of `chunk` (chunk-local) that come from / go to each peer, chunks in ascending order.
    Every rank computes the same plan, so a send always meets its receive."""
    c = seq // (2 * cp)
    need: list[dict[int, dict[int, int]]] = [{} for _ in range(cp)]  # rank -> peer -> chunk -> lowest row
    for r in range(cp):
        for qc in (r, 2 * cp - 1 - r):
            first = max(0, qc * c - (window - 1))  # the earliest position a query of chunk qc sees
            for kc in range(first // c, qc):
                peer = chunk_owner(kc, cp)
                if peer == r:
                    continue  # its own chunk: at hand
                lo = max(first, kc * c) - kc * c
                rows = need[r].setdefault(peer, {})
                rows[kc] = min(rows.get(kc, c), lo)  # two query chunks may need one chunk: the longer tail
    plan = [{"recv": {}, "send": {}} for _ in range(cp)]
    for r in range(cp):
        for peer, rows in sorted(need[r].items()):
            spans = tuple((kc, lo, c) for kc, lo in sorted(rows.items()))
            plan[r]["recv"][peer] = spans
            plan[peer]["send"][r] = spans
    return tuple(plan)


def rows_of(spans) -> int:
    """Rows in a message of `spans`."""
    return sum(hi - lo for _, lo, hi in spans)


def window_rows(seq: int, cp: int, window: int, rank: int) -> tuple[int, int]:
    """(rows rank `rank` sends, rows it receives) in one local layer's forward exchange."""
    p = window_plan(seq, cp, window)[rank]
    return sum(rows_of(s) for s in p["send"].values()), sum(rows_of(s) for s in p["recv"].values())
