"""Gradient buckets: which parameters are reduced together, for labkit's DDP and ZeRO-1/2
(`lab_buckets`, `grouped_buckets`) and for PyTorch's DDP (`torch_ddp_buckets`, which the theory
predicts). Pure Python: the engines bucket by these rules and the theory reads the same ones.

labkit's rule: parameters in reverse registration order — roughly the order backward produces
their gradients — packed greedily into buckets of at most `cap_bytes` (a parameter larger than
the cap gets a bucket of its own). This is PyTorch DDP's rule (Li et al., "PyTorch
Distributed", VLDB 2020, section 3.2.3) without its smaller first bucket.
"""

from __future__ import annotations


def lab_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Indices (into sizes_bytes) of each bucket, in launch order."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_bytes))):
        if current and filled + sizes_bytes[i] > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes_bytes[i]
    if current:
        buckets.append(current)
    return buckets


def grouped_buckets(sizes_bytes: list[int], keys: list, cap_bytes: int) -> list[tuple[object, list[int]]]:
    """Buckets when parameters are reduced over different groups: (key, indices) per bucket.
    Parameters are grouped by `keys[i]` (the dims their gradient is reduced over), each group
    bucketed as above, and all buckets launched by their last parameter, latest first — the
    order backward produces them."""
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    out = []
    for k, idx in groups.items():
        out += [(k, [idx[j] for j in b]) for b in lab_buckets([sizes_bytes[i] for i in idx], cap_bytes)]
    return sorted(out, key=lambda kb: -kb[1][0])


def torch_ddp_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """PyTorch DDP's rebuilt buckets (from iteration 2 on, with an explicit bucket_cap_mb):
    gradients in ready order (~ reverse registration), a bucket closes once it reaches the cap
    (PyTorch closes a bucket after the parameter that fills it; labkit's rule before it)."""
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
