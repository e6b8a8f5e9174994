"""The device mesh on every rank: the torch.distributed process groups of a MeshLayout.

`MeshLayout` (labkit/layout/mesh.py) is the pure rank/coordinate/group arithmetic; `Mesh` adds
the process groups. It is built once per layout on every rank, in the same order, and cached,
so re-running a layout on a warm cluster creates no new groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from labkit.config import DIMS
from labkit.engines.meters.comm import unlogged
from labkit.layout.mesh import COMBINED, DATA_DIMS, MeshLayout, dim_name, hybrid_combined, shard_dims


class Mesh:
    """A MeshLayout plus this rank's torch.distributed groups, for every dim and combination.

    Build it with `Mesh.build(layout, rank)` on every rank of the world (ranks outside the
    layout take part in group creation and then stay idle). Groups are cached by their rank
    tuple across layouts, so a warm cluster re-running layouts creates each group once.
    """

    _pg_cache: dict[tuple[int, ...], object] = {}  # per engine process: rank tuple -> group
    _mesh_cache: dict[tuple, Mesh] = {}

    def __init__(self, layout: MeshLayout, rank: int):
        self.layout = layout
        self.rank = rank
        self._groups: dict[tuple[str, ...], object] = {}
        self._group_ranks: dict[tuple[str, ...], list[int]] = {}
        self.dim_of: dict[str, str] = {}  # process group name -> dim name (for the comm meter)
        self._sub: dict[tuple, object] = {}  # (dim, run length | 'ends') -> group (MeshLayout.subgroups)
        self._device_mesh: DeviceMesh | None = None  # device_mesh_2d's, once built
        self._control = None  # the layout's control group (`agree`)

    @classmethod
    def build(cls, layout: MeshLayout, rank: int) -> Mesh:
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
        world = dist.get_world_size()
        every = [(d,) for d in DIMS] + [self.layout.canonical(c) for c in COMBINED]
        for dims in every + hybrid_combined(self.layout):  # HSDP's shard and replicate groups last
            if dims in self._groups:
                continue
            mine = None
            for ranks in self.layout.groups(*dims):  # same order on every rank
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
        for dim, kind, ranks in self.layout.subgroups():  # same order on every rank
            key = tuple(ranks)
            if key not in self._pg_cache:
                self._pg_cache[key] = dist.new_group(ranks)
            if self.rank in ranks:
                self._sub[dim, kind] = self._pg_cache[key]
        # the layout's control group (`agree`): every rank of it, created by every rank of the world like the
        # others. Its flag lives on the host: on gloo the layout's own group of all its ranks, which a layout
        # along one dim has already (no group more per layout); under NCCL one of gloo's beside it
        ranks = tuple(range(self.layout.world))
        key = ranks if dist.get_backend() != "nccl" else ("control", *ranks)
        if key not in self._pg_cache:
            if key == ranks and self.layout.world == world:
                self._pg_cache[key] = dist.group.WORLD
            else:
                self._pg_cache[key] = dist.new_group(list(ranks), backend="gloo" if key != ranks else None)
        self._control = self._pg_cache[key]

    def agree(self, flag: bool) -> bool:
        """Whether any rank of the layout says `flag` (all of them must ask): one all-reduce (max) of
        one int on the control group, left out of the collective log and the run's comm rows — it is
        the lab's own bookkeeping, not the layout's traffic (engines/runtime.py `stop_agreed`)."""
        # one rank, or a dry run's fake world (engines/dryrun.py: one rank alone, its collectives empty)
        if self.layout.world == 1 or dist.get_backend() == "fake":
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        with unlogged():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control)
        return bool(t.item())

    def device_mesh_2d(self, device_type: str) -> DeviceMesh:
        """One (dp, tp) DeviceMesh over this layout, from this mesh's own dp and tp groups (no new
        process group), built on first use and kept with the mesh: DTensor TP takes its ["tp"]
        slice, FSDP2 its ["dp"] (engines/parallel/tensor/dtensor.py, fsdp.py)."""
        if self._device_mesh is None:
            lay, here = self.layout, self.coords
            ranks = [
                [lay.rank(**{**here, "dp": d, "tp": t}) for t in range(lay.size("tp"))] for d in range(lay.size("dp"))
            ]  # (dp, tp) global ranks
            self._device_mesh = DeviceMesh.from_group(
                [self.group("dp"), self.group("tp")], device_type, torch.tensor(ranks), mesh_dim_names=("dp", "tp")
            )
        return self._device_mesh

    def device_mesh_hsdp(self, device_type: str) -> DeviceMesh:
        """One (dp_replicate, dp_shard) DeviceMesh over this layout for FSDP2's HSDP, from this mesh's
        own groups (no new process group): the shard dim is the data dims' shard group (dp_shard x
        ep x cp, as FSDP2 alone takes the data dims' group), the replicate dim dp_replicate. Row i
        holds the shard group of the i-th replica of this rank (a shard group shifted by a constant
        rank offset, so sorted rows line up column by column)."""
        lay, dims = self.layout, shard_dims(DATA_DIMS, True)
        ranks = [lay.group_of(r, *dims) for r in self.ranks("dp_replicate")]  # (dp_replicate, dp_shard)
        return DeviceMesh.from_group(
            [self.group("dp_replicate"), self.group(*dims)],
            device_type,
            torch.tensor(ranks),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )

    def run_group(self, dim: str, k: int):
        """This rank's run of k consecutive coordinates along `dim` (the tp ranks sharing a KV head)."""
        return self.group(dim) if k == self.size(dim) else self._sub[dim, k]

    def stride_group(self, dim: str, k: int):
        """This rank's coordinates along `dim` equal to its own mod k (MeshLayout.strides)."""
        return self._sub[dim, ("stride", k)]

    def ends_group(self, dim: str):
        """The group of the first and last rank along `dim`, for a rank that is one of them (the
        pp stages holding a tied embedding's two copies)."""
        return self.group(dim) if self.size(dim) == 2 else self._sub[dim, "ends"]

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
