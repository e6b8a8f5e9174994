"""Which variants of a mesh the planner's search tries beyond its degrees (search.py enumerates the
degrees): the context-parallel kinds where cp > 1, and HSDP for a sharded data-parallel layout.
Each variant is a candidate the search prices, but the all-gather cp kind, left out as dominated."""

from __future__ import annotations

from labkit.config import ParallelConfig
from labkit.config.choices import CONTEXT_KINDS, context_comm
from labkit.config.choices import sharded as sharding_of
from labkit.theory.planner.hardware import Hardware

SEARCHED_KINDS = tuple(k for k in CONTEXT_KINDS if not context_comm(k).gathers)
"""The cp kinds the search tries unless one is held. The all-gather is left out as dominated in this
model: it sends the ring's bytes (an all-gather over cp is the ring's cp-1 hops; timing.py), none of
them hidden behind attention, and holds more (the gathered K/V and fp32 dK/dV: gpu_memory.py), so
its time and memory are never below the ring's. Held (fixed={"cp_kind": "allgather"}) it is priced."""


def with_kinds(meshes, fixed: dict, hw: Hardware):
    """Each mesh with each cp kind it can take, as (..., kind, cp_a2a): SEARCHED_KINDS where cp > 1
    (none of those dominates another: the ring hides its hops behind attention, Ulysses moves q,
    K/V and the output but needs heads that divide and sends less; hierarchical once per proper
    divisor of cp whose run fits in a node, as its all-to-all's size), the ring alone where cp = 1
    (the kinds differ only with cp)."""
    for mesh in meshes:
        cp = mesh[1]
        kinds = (fixed["cp_kind"],) if "cp_kind" in fixed else SEARCHED_KINDS if cp > 1 else ("ring",)
        for kind in kinds:
            if not context_comm(kind).hierarchical:
                yield (*mesh, kind, 1)
                continue
            # a run's all-to-all inside a node (tp·cp_a2a GPUs, tp innermost), the point of the kind: one
            # that spans nodes is Ulysses' traffic on the slow link with a ring's latency on top
            tp = mesh[0]
            runs = (
                (fixed["cp_a2a"],)
                if "cp_a2a" in fixed
                else [a for a in range(2, cp) if cp % a == 0 and tp * a <= hw.gpus_per_node]
            )
            for a in runs:
                yield (*mesh, kind, a)


def hybrids(shardings, mesh: ParallelConfig, hw: Hardware, fixed: dict):
    """(sharding, dp_replicate) pairs: each sharding flat (dp_replicate=1), and a sharded one also as
    HSDP with a shard group that fills a node (torchtitan's multi-node default: shard inside the
    node, replicate across) or 2, 4 or 8 nodes, where dp holds more than one such group. A held
    dp_replicate is the only one tried."""
    # the ranks of a node before dp's in the default order: tp·cp·ep of them for each dp coordinate
    group = hw.gpus_per_node // (mesh.tp * mesh.cp * mesh.ep)
    for sharding in shardings:
        if "dp_replicate" in fixed:
            yield sharding, fixed["dp_replicate"]
            continue
        yield sharding, 1
        if not sharding_of(sharding).stage:
            continue
        # a node's group, or 2, 4, 8 nodes' (a model whose states do not fit sharded over one node)
        for g in sorted({group * k for k in (1, 2, 4, 8)}):
            if 1 < g < mesh.dp and mesh.dp % g == 0:
                yield sharding, mesh.dp // g
