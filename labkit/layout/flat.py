"""Flat buffers for sharded data parallelism (ZeRO, Rajbhandari et al., SC 2020, section 5;
FSDP, Zhao et al., VLDB 2023, section 3.2): which parameters share one, in what order, and how
it is cut into N equal shards, rank i holding the i-th. Pure Python: the engines' ZeRO / FSDP
(engines/parallel/zero.py, shards.py) build these layouts and the theory counts their bytes.

    padded = ceil(numel / N) * N,    shard = padded / N   (elements per rank, padding included)

Matrices come first in a buffer, vectors after, so a shard's weight-decay mask is two runs.
Two groupings: `bucket_layouts` (ZeRO-1/2, DDP's buckets) and `unit_layouts` (ZeRO-3 / FSDP, one
buffer per module gathered as a whole). A buffer only holds parameters reduced over the same
dims and is sharded over exactly that group (`FlatLayout.dims`), and under fp8 a unit's weights that
are gathered in fp8 get a buffer of their own (`FlatLayout.fp8`); DERIVATIONS.md, "Flat buffers", says why.
Entries are (name, shape) — whole-model data parallelism, dims dp-ep-cp — or
(name, shape, dims) or (name, shape, dims, chunk); `n` is one group size or {dims: size}.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from labkit.layout.buckets import grouped_buckets
from labkit.layout.mesh import DATA_DIMS


def padded(numel: int, n: int) -> int:
    """numel rounded up to a multiple of n (the padding rule)."""
    return -(-numel // n) * n


def is_matrix(shape) -> bool:
    """Weight decay applies to tensors of 2 or more dims (engines/optim.py: decays)."""
    return len(shape) >= 2


@dataclass(frozen=True)
class FlatLayout:
    """One flat buffer: parameter names in buffer order (matrices first), their sizes, N shards."""

    unit: str
    """Module path the buffer belongs to ('blocks.0', '' for the root) or 'bucket<k>'."""
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    n: int
    dims: tuple[str, ...] = DATA_DIMS
    """Mesh dims of the n ranks that share the buffer, shard it and reduce its gradients."""
    fp8: bool = False
    """Gathered in fp8, one byte an element (FSDP's float8 all-gather: its tensors are fp8 linears'
    weights, each rank's shard cast with the tensors' scales of the step); else in the compute dtype."""

    @classmethod
    def of(cls, unit: str, named_shapes, n: int, dims: tuple[str, ...] = DATA_DIMS, fp8: bool = False) -> FlatLayout:
        ordered = [x for x in named_shapes if is_matrix(x[1])] + [x for x in named_shapes if not is_matrix(x[1])]
        return cls(unit, tuple(a for a, _ in ordered), tuple(tuple(s) for _, s in ordered), n, tuple(dims), fp8)

    @property
    def numels(self) -> list[int]:
        return [prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        return padded(self.numel, self.n)

    @property
    def shard(self) -> int:
        return self.padded // self.n

    @property
    def decay_numel(self) -> int:
        """The first decay_numel elements are matrices (weight-decayed); the rest are not."""
        return sum(k for k, s in zip(self.numels, self.shapes) if is_matrix(s))

    def offsets(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        """(name, shape, start, stop) of each parameter in the buffer."""
        out, at = [], 0
        for name, shape, k in zip(self.names, self.shapes, self.numels):
            out.append((name, shape, at, at + k))
            at += k
        return out

    def owned(self, index: int) -> tuple[int, int]:
        """[start, stop) of the buffer that shard `index` holds (padding included)."""
        return index * self.shard, (index + 1) * self.shard

    def real(self, index: int) -> int:
        """How many leading elements of shard `index` are parameters (the rest is padding)."""
        a, b = self.owned(index)
        return max(0, min(b, self.numel) - a)

    def runs(self, index: int) -> list[tuple[int, int, bool]]:
        """The decay mask of shard `index` as runs [start, stop) local to the shard, with their flag."""
        a, b = self.owned(index)
        cut = min(max(self.decay_numel - a, 0), b - a)
        return [(lo, hi, d) for lo, hi, d in ((0, cut, True), (cut, b - a, False)) if hi > lo]

    def pieces(self, index: int) -> list[tuple[str, tuple[int, ...], int, int, int]]:
        """(name, shape, flat start, flat stop within the parameter, offset within the shard) of every
        parameter part that shard `index` holds."""
        a, b = self.owned(index)
        out = []
        for name, shape, lo, hi in self.offsets():
            s, e = max(lo, a), min(hi, b)
            if s < e:
                out.append((name, shape, s - lo, e - lo, s - a))
        return out


def _entries(named) -> list[tuple[str, tuple[int, ...], tuple[str, ...], int]]:
    """(name, shape, reduce dims, pipeline chunk) of each entry (module docstring)."""
    return [(e[0], tuple(e[1]), tuple(e[2]) if len(e) > 2 else DATA_DIMS, e[3] if len(e) > 3 else 0) for e in named]


def _size(n, dims) -> int:
    return n if isinstance(n, int) else n[dims]


def bucket_layouts(named, n, cap_bytes: int, elem_bytes: int) -> list[FlatLayout]:
    """ZeRO-1/2: DDP's buckets (per reduce group and chunk, reverse registration order,
    `cap_bytes` of gradients each; buckets.grouped_buckets), in launch order, each one flat buffer."""
    entries = _entries(named)
    sizes = [prod(s) * elem_bytes for _, s, _, _ in entries]
    keys = [(dims, chunk) for _, _, dims, chunk in entries]
    return [
        FlatLayout.of(f"bucket{k}", [entries[i][:2] for i in idx], _size(n, key[0]), key[0])
        for k, (key, idx) in enumerate(grouped_buckets(sizes, keys, cap_bytes))
    ]


def unit_kind(per_module: bool, tied: bool) -> str:
    """The unit grouping: ZeRO-3's one unit per top-level module (`per_module`, Sharded.per_module_units)
    'zero3', else FSDP's root and blocks 'fsdp'. A tied model's embedding and head share one weight,
    so under zero3 they are one unit, the root, gathered around the whole forward (as fsdp's root
    is): 'zero3-tied'."""
    if per_module:
        return "zero3-tied" if tied else "zero3"
    return "fsdp"


def unit_of(name: str, kind: str) -> str:
    """The unit (module path) that owns parameter `name`: 'blocks.<i>' for a block's; otherwise
    the top-level module ('embed', 'head') under zero3, the root ('') under fsdp and zero3-tied."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return ".".join(parts[:2])
    return parts[0] if kind == "zero3" else ""


def unit_layouts(named, n, kind: str, fp8: frozenset[str] = frozenset()) -> list[FlatLayout]:
    """ZeRO-3 / FSDP units in forward order: zero3 embed, blocks.0.., head; fsdp the root (''),
    then blocks.0.. (the root's hooks run around the whole forward). A module whose parameters
    are reduced over different dims gets one buffer per group, and one for the weights it gathers
    in fp8 (`fp8`: their names), in registration order."""
    units: dict[tuple, list] = {}
    for name, shape, dims, _ in _entries(named):
        units.setdefault((unit_of(name, kind), dims, name in fp8), []).append((name, shape))
    first = {key: i for i, key in enumerate(units)}
    order = sorted(
        units,
        key=lambda k: (
            k[0] != "",
            k[0] != "embed",
            k[0] == "head",
            int(k[0].split(".")[1]) if k[0].startswith("blocks.") else -1,
            first[k],
        ),
    )
    return [FlatLayout.of(u, units[u, dims, f], _size(n, dims), dims, f) for u, dims, f in order]
