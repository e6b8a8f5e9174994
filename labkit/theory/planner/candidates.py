"""Which variants of a mesh the planner's search tries beyond its degrees (search.py enumerates the
degrees): the context-parallel kinds where cp > 1, and HSDP for a sharded data-parallel layout.
Each variant is a candidate: the search prices it, and none is left out as dominated."""

from __future__ import annotations

from labkit.config import ParallelConfig
from labkit.config.choices import CONTEXT_KINDS, context_comm
from labkit.config.choices import sharded as sharding_of
from labkit.theory.planner.hardware import Hardware


def with_kinds(meshes, fixed: dict):
    """Each mesh with each cp kind it can take, as (..., kind, cp_a2a): every kind where cp > 1 (none
    dominates another: the ring hides its hops behind attention, the all-gather sends K/V once,
    Ulysses moves q, K/V and the output but needs heads that divide; hierarchical once per proper
    divisor of cp as its all-to-all's size), the ring alone where cp = 1 (the kinds differ only
    with cp)."""
    for mesh in meshes:
        cp = mesh[1]
        kinds = (fixed["cp_kind"],) if "cp_kind" in fixed else CONTEXT_KINDS if cp > 1 else ("ring",)
        for kind in kinds:
            if not context_comm(kind).hierarchical:
                yield (*mesh, kind, 1)
                continue
            runs = (fixed["cp_a2a"],) if "cp_a2a" in fixed else [a for a in range(2, cp) if cp % a == 0]
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
