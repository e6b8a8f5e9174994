"""The device mesh: rank <-> coordinates for an order string, and every process group.

Like picotron, the whole rank grid is one array: `arange(world).reshape(sizes in outer-to-inner
order)`; every coordinate and every group is read off it. The order string names the
dimensions innermost first (Megatron's convention): with "tp-cp-ep-dp-pp", ranks 0 and 1 differ
in tp, so a TP group holds neighbouring ranks (one node's fast links).

`MeshLayout` is pure arithmetic, importable without torch or processes (the mesh view draws
it, the theory reads it). `Mesh` adds the torch.distributed groups; it is built once per layout
on every rank, in the same order, and cached, so re-running a layout on a warm cluster creates
no new groups.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from labkit.config import DIMS, ParallelConfig


def dim_name(dims) -> str:
    """Name of a (combined) mesh dimension: 'dp', or 'dp-cp' for the dp x cp groups."""
    return "-".join(dims)


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the five dims and their order; pure rank/coordinate/group arithmetic."""

    sizes: tuple[tuple[str, int], ...]
    order: str = "tp-cp-ep-dp-pp"

    @classmethod
    def of(cls, cfg: ParallelConfig) -> "MeshLayout":
        return cls(tuple((d, getattr(cfg, d)) for d in DIMS), cfg.order)

    @classmethod
    def from_sizes(cls, order: str = "tp-cp-ep-dp-pp", **sizes: int) -> "MeshLayout":
        return cls(tuple((d, int(sizes.get(d, 1))) for d in DIMS), order)

    @property
    def inner_first(self) -> list[str]:
        return self.order.split("-")

    def size(self, *dims: str) -> int:
        s = dict(self.sizes)
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
        axes = [self._axis(d) for d in dims]
        rest = [a for a in range(self.grid.ndim) if a not in axes]
        moved = np.transpose(self.grid, rest + axes)   # (other dims..., dims...)
        flat = moved.reshape(-1, self.size(*dims))     # one row per group
        return sorted(sorted(int(r) for r in row) for row in flat)

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The ranks in `rank`'s group along `dims`."""
        for g in self.groups(*dims):
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is outside this mesh of {self.world} ranks")

    def canonical(self, dims) -> tuple[str, ...]:
        """Dims in mesh order (innermost first), so 'cp-dp' and 'dp-cp' name one group set."""
        unknown = [d for d in dims if d not in DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dim(s) {unknown}; dims are {list(DIMS)}")
        return tuple(d for d in self.inner_first if d in dims)

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
                warning = (f"{d}={self.size(d)} groups span hosts ({len(across)} of {len(groups)}, e.g. ranks "
                           f"{across[0]} on {sorted({hosts[r] for r in across[0]})}): {AXIS_WARNINGS[d]}")
            out.append({"dim": d, "size": self.size(d), "groups": groups, "spans_hosts": across,
                        "warning": warning})
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


class Mesh:
    """A MeshLayout plus this rank's torch.distributed groups, for every dim and combination.

    Build it with `Mesh.build(layout, rank)` on every rank of the world (ranks outside the
    layout take part in group creation and then stay idle). Groups are cached by their rank
    tuple across layouts, so a warm cluster re-running layouts creates each group once.
    """

    _pg_cache: dict[tuple[int, ...], object] = {}   # per engine process: rank tuple -> group
    _mesh_cache: dict[tuple, "Mesh"] = {}

    def __init__(self, layout: MeshLayout, rank: int):
        self.layout = layout
        self.rank = rank
        self._groups: dict[tuple[str, ...], object] = {}
        self._group_ranks: dict[tuple[str, ...], list[int]] = {}
        self.dim_of: dict[str, str] = {}   # process group name -> dim name (for the comm meter)

    @classmethod
    def build(cls, layout: MeshLayout, rank: int) -> "Mesh":
        key = (layout, rank)
        if key not in cls._mesh_cache:
            mesh = cls(layout, rank)
            mesh._create_groups()
            cls._mesh_cache[key] = mesh
        return cls._mesh_cache[key]

    @classmethod
    def forget_groups(cls) -> None:
        """Drop every cached group (after the process group was destroyed and rebuilt)."""
        cls._pg_cache.clear()
        cls._mesh_cache.clear()

    def _create_groups(self) -> None:
        import torch.distributed as dist

        world = dist.get_world_size()
        for dims in [(d,) for d in DIMS] + [self.layout.canonical(c) for c in COMBINED]:
            if dims in self._groups:
                continue
            mine = None
            for ranks in self.layout.groups(*dims):   # same order on every rank
                key = tuple(ranks)
                if key not in self._pg_cache:
                    if len(ranks) == world:
                        self._pg_cache[key] = dist.group.WORLD
                    else:
                        self._pg_cache[key] = dist.new_group(ranks)
                if self.rank in ranks:
                    mine = ranks
            if mine is not None:
                pg = self._pg_cache[tuple(mine)]
                self._groups[dims] = pg
                self._group_ranks[dims] = mine
                if len(mine) > 1:
                    self.dim_of.setdefault(pg.group_name, dim_name(dims))

    @property
    def active(self) -> bool:
        """Whether this rank is part of the layout (a world larger than it leaves ranks idle)."""
        return self.rank < self.layout.world

    def group(self, *dims: str):
        """This rank's process group along the (combined) dims."""
        return self._groups[self.layout.canonical(dims)]

    def ranks(self, *dims: str) -> list[int]:
        """Global ranks in this rank's group along `dims`."""
        return self._group_ranks[self.layout.canonical(dims)]

    def size(self, *dims: str) -> int:
        return self.layout.size(*dims)

    def coord(self, dim: str) -> int:
        return self.layout.coords(self.rank)[dim]

    @property
    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def name(self, *dims: str) -> str:
        return dim_name(self.layout.canonical(dims))


def all_layouts(world: int, order: str = "tp-cp-ep-dp-pp"):
    """Every MeshLayout whose degrees multiply to `world` (for tests and the widgets)."""
    for combo in itertools.product(range(1, world + 1), repeat=len(DIMS)):
        if int(np.prod(combo)) == world:
            yield MeshLayout(tuple(zip(DIMS, combo)), order)
