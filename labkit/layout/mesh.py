"""The mesh layout: rank <-> coordinates for an order string, and every group of every dim.

Like picotron, the whole rank grid is one array: `arange(world).reshape(sizes in outer-to-inner
order)`; every coordinate and every group is read off it. The order string names the
dimensions innermost first (Megatron's convention): with "tp-cp-ep-dp-pp", ranks 0 and 1 differ
in tp, so a TP group holds neighbouring ranks (one node's fast links).

Pure arithmetic (numpy, no torch): the engines' `Mesh` (engines/mesh.py) creates a process
group for each group listed here, the theory prices them, the mesh view draws them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from labkit.config import DIMS, ParallelConfig

DATA_DIMS = ("dp", "ep", "cp")
"""Dims whose ranks see different tokens: a dense parameter's gradient is summed over them."""
SUB_DIMS = ("dp_shard", "dp_replicate")
"""HSDP's halves of dp (ParallelConfig.dp_replicate), innermost first: both sit at dp's place in
the order, the shard group on consecutive dp coordinates, the replicas across them."""


def shard_dims(dims: tuple[str, ...], hybrid: bool) -> tuple[str, ...]:
    """The dims a flat buffer of parameters reduced over `dims` is sharded over: the same dims, or
    under HSDP (`hybrid`) with dp's shard sub-dim in dp's place (the replicas all-reduce the shard)."""
    return tuple("dp_shard" if d == "dp" else d for d in dims) if hybrid else tuple(dims)


def dim_name(dims) -> str:
    """Name of a (combined) mesh dimension: 'dp', or 'dp-cp' for the dp x cp groups."""
    return "-".join(dims)


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the five dims and their order; pure rank/coordinate/group arithmetic."""

    sizes: tuple[tuple[str, int], ...]
    order: str = "tp-cp-ep-dp-pp"
    dp_replicate: int = 1
    """HSDP: dp read as dp_replicate x dp_shard (SUB_DIMS), replicate outside; 1: dp is one dim."""

    @classmethod
    def of(cls, cfg: ParallelConfig) -> MeshLayout:
        return cls(tuple((d, getattr(cfg, d)) for d in DIMS), cfg.order, cfg.dp_replicate)

    @classmethod
    def from_sizes(cls, order: str = "tp-cp-ep-dp-pp", dp_replicate: int = 1, **sizes: int) -> MeshLayout:
        return cls(tuple((d, int(sizes.get(d, 1))) for d in DIMS), order, dp_replicate)

    @property
    def inner_first(self) -> list[str]:
        return self.order.split("-")

    @property
    def fine_inner_first(self) -> list[str]:
        """inner_first with dp's two HSDP sub-dims beside it: (.., 'dp_shard', 'dp', 'dp_replicate', ..)
        sorts a combined name's dims; the fine grid has the two sub-dims only."""
        out = []
        for d in self.inner_first:
            out += ["dp_shard", "dp", "dp_replicate"] if d == "dp" else [d]
        return out

    def size(self, *dims: str) -> int:
        s = dict(self.sizes)
        s["dp_replicate"] = self.dp_replicate
        s["dp_shard"] = s["dp"] // self.dp_replicate
        return math.prod(s[d] for d in dims)

    @property
    def world(self) -> int:
        return self.size(*DIMS)

    @cached_property
    def grid(self) -> np.ndarray:
        """Ranks as an array with one axis per dim, outermost first: grid[pp, dp, ep, cp, tp]."""
        outer_first = self.inner_first[::-1]
        return np.arange(self.world).reshape([self.size(d) for d in outer_first])

    def _axis(self, d: str) -> int:
        return self.inner_first[::-1].index(d)

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': .., 'cp': .., 'ep': .., 'dp': .., 'pp': ..} of a rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside this mesh of {self.world} ranks")
        idx = np.unravel_index(rank, self.grid.shape)
        return {d: int(idx[self._axis(d)]) for d in DIMS}

    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (missing dims are 0)."""
        idx = tuple(coords.get(d, 0) for d in self.inner_first[::-1])
        return int(self.grid[idx])

    def groups(self, *dims: str) -> list[list[int]]:
        """Every group of the (combined) dims: ranks that differ only in `dims`, each sorted.

        Groups are listed in a fixed order (by their smallest rank), so every rank that
        walks this list creates the same process groups in the same order.
        """
        dims = self.canonical(dims)
        fine = [d for d in self.fine_inner_first[::-1] if d != "dp"]  # the fine grid's axes, outermost first
        grid = self.grid.reshape([self.size(d) for d in fine])  # dp's axis cut into (dp_replicate, dp_shard)
        wanted = {s for d in dims for s in (SUB_DIMS if d == "dp" else (d,))}
        axes = [fine.index(d) for d in fine if d in wanted]
        rest = [a for a in range(grid.ndim) if a not in axes]
        moved = np.transpose(grid, rest + axes)  # (other dims..., dims...)
        flat = moved.reshape(-1, self.size(*dims))  # one row per group
        return sorted(sorted(int(r) for r in row) for row in flat)

    def runs(self, dim: str, k: int) -> list[list[int]]:
        """Each group of `dim` cut into runs of k consecutive coordinates: the tp ranks that share
        one KV head when tp > kv_heads (k = tp / kv_heads; layout/tensor.py)."""
        return [g[i : i + k] for g in self.groups(dim) for i in range(0, len(g), k)]

    def ends(self, dim: str) -> list[list[int]]:
        """The first and last rank of each group of `dim`: a tied embedding's two pipeline stages,
        which all-reduce its gradient (Megatron-LM's embedding group)."""
        return [[g[0], g[-1]] for g in self.groups(dim) if len(g) > 1]

    def strides(self, dim: str, k: int) -> list[list[int]]:
        """Each group of `dim` cut into the k sets of coordinates equal mod k: with `runs(dim, k)`
        the two levels of hierarchical context parallelism (an all-to-all inside each run of k, a
        ring across the runs through each stride)."""
        return [g[j::k] for g in self.groups(dim) for j in range(k)]

    def subgroups(self) -> list[tuple[str, object, list[int]]]:
        """(the dim they belong to, which kind of subgroup, ranks) of every group below a dim, listed
        in one fixed order: tp runs of each proper divisor k of tp (whichever kv_heads a model
        has; kind k), the pp ends ('ends'), and for each proper divisor k of cp its runs of k
        (kind k) and its strides of k (kind ('stride', k)), whichever cp_a2a a layout asks for."""
        t, c = self.size("tp"), self.size("cp")
        out = [("tp", k, g) for k in range(2, t) if t % k == 0 for g in self.runs("tp", k)]
        out += [("pp", "ends", g) for g in self.ends("pp")]
        for k in (k for k in range(2, c) if c % k == 0):
            out += [("cp", k, g) for g in self.runs("cp", k)] + [
                ("cp", ("stride", k), g) for g in self.strides("cp", k)
            ]
        return out

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The ranks in `rank`'s group along `dims`."""
        for g in self.groups(*dims):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is outside this mesh of {self.world} ranks")

    def canonical(self, dims) -> tuple[str, ...]:
        """Dims in mesh order (innermost first), so 'cp-dp' and 'dp-cp' name one group set."""
        unknown = [d for d in dims if d not in DIMS + SUB_DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dim(s) {unknown}; dims are {list(DIMS)} and HSDP's {list(SUB_DIMS)}")
        return tuple(d for d in self.fine_inner_first if d in dims)

    def spans_hosts(self, dims, hosts: list[str]) -> list[list[int]]:
        """Groups along `dims` whose ranks sit on more than one host (hosts[rank])."""
        return [g for g in self.groups(*dims) if len({hosts[r] for r in g}) > 1]

    def label(self, *dims: str) -> str:
        """The name a group along `dims` goes by in reports: its dims of size > 1, in mesh order
        ('dp-cp' when both are > 1, 'dp' when cp == 1); the full name if all are size 1."""
        dims = self.canonical(dims)
        return dim_name(tuple(d for d in dims if self.size(d) > 1) or dims)

    def describe(self) -> str:
        s = dict(self.sizes)
        return " x ".join(f"{d}{s[d]}" for d in self.inner_first[::-1] if s[d] > 1) or "1 rank"

    def axes(self, hosts: list[str] | None = None) -> list[dict]:
        """Per-axis report, one entry per dim in mesh order (innermost first): its size, its
        groups, and, given the host of each rank (`hosts[rank]`), the groups that span hosts
        and a warning where that hurts (`AXIS_WARNINGS`). Pure data, for the mesh view and Lab.run."""
        out = []
        for d in self.inner_first:
            groups = self.groups(d)
            across = self.spans_hosts((d,), hosts) if hosts is not None and self.size(d) > 1 else []
            warning = None
            if across and d in AXIS_WARNINGS:
                warning = (
                    f"{d}={self.size(d)} groups span hosts ({len(across)} of {len(groups)}, e.g. ranks "
                    f"{across[0]} on {sorted({hosts[r] for r in across[0]})}): {AXIS_WARNINGS[d]}"
                )
            out.append({"dim": d, "size": self.size(d), "groups": groups, "spans_hosts": across, "warning": warning})
        return out

    def warnings(self, hosts: list[str]) -> list[str]:
        """The warnings of `axes(hosts)`: the layout puts a latency-critical group across hosts."""
        return [a["warning"] for a in self.axes(hosts) if a["warning"]]


AXIS_WARNINGS = {
    "tp": "tensor parallelism talks after every layer (two all-reduces of the (b, s, h) activations per "
    "layer forward and two backward, on the critical path) and needs the fast intra-node links "
    "(NVLink); keep tp within a host (tp <= ranks per host, tp innermost in `order`)",
}
"""Why a group of a dim should not span hosts; dims without an entry tolerate it (dp's gradient
reduction overlaps backward, pp sends one activation per microbatch)."""


# Every combination of dims a strategy may ask for (gradient reduction over dp-ep-cp, the norm
# over whichever of tp-pp-ep-dp split the parameters, ...). Building them all up front keeps
# group creation identical on every rank (a rank that builds a group the others do not is a
# classic hang); groups with the same ranks are created once, so this stays cheap.
COMBINED = tuple(c for k in range(2, len(DIMS) + 1) for c in itertools.combinations(DIMS, k))


def hybrid_combined(layout: MeshLayout) -> list[tuple[str, ...]]:
    """Under HSDP, the groups its strategies ask for beyond COMBINED's, listed in one fixed order:
    dp_replicate alone, and every single or combined dim with dp, dp's shard sub-dim in its place
    (a flat buffer's shard group: dp_shard x ep x cp, ...). Without HSDP, none."""
    if layout.dp_replicate == 1:
        return []
    with_dp = [c for c in [(d,) for d in DIMS] + list(COMBINED) if "dp" in c]
    return [("dp_replicate",)] + [layout.canonical(shard_dims(c, True)) for c in with_dp]
