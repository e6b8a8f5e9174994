"""Full tensors from every rank's pieces, with every copy of every element compared.

A layout spreads each parameter (and its gradient, and the weights forward reads) over ranks in
pieces (engines/parallel/common.py `piece`): TP and EP slices, ZeRO / FSDP flat ranges, and whole
replicas — DDP's data-parallel copies, TP-replicated LayerNorms, MoE layers replicated over tp,
dense weights replicated over ep, ZeRO's all-gathered buffers. Assembling writes each element
once and compares every further copy with the first, bit for bit: replicas are made identical by
construction (each is the same update of the same all-reduced, all-gathered or identically
computed values), so any difference is a bug, and the report names the tensor and the two ranks.
Non-finite values are reported per tensor and rank as they are read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import prod

import numpy as np


@dataclass(frozen=True)
class PieceIssue:
    """Something wrong with the pieces of one tensor: copies that differ, or non-finite values."""

    kind: str
    """'differs' (two ranks hold different values for the same elements) or 'not finite'."""
    what: str
    """'parameters', 'gradients' (the first step's, reduced) or 'working weights'."""
    name: str
    ranks: tuple[int, ...]
    """'differs': (the rank whose copy was read first, the rank whose copy differs); else (the rank,)."""
    elements: int
    largest: float = 0.0
    """'differs': the largest |difference| between the two copies."""

    def __str__(self) -> str:
        if self.kind == "differs":
            a, b = self.ranks
            return (
                f"{self.what} {self.name}: rank {b}'s copy differs from rank {a}'s in {self.elements} "
                f"element(s) (largest |difference| {self.largest:.3g})"
            )
        return f"{self.what} {self.name}: {self.elements} non-finite element(s) on rank {self.ranks[0]}"

    def to_dict(self) -> dict:
        return {**asdict(self), "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, d: dict) -> PieceIssue:
        return cls(**{**d, "ranks": tuple(d["ranks"])})


def _positions(pc: dict, index: np.ndarray) -> np.ndarray:
    """Flat positions in the full tensor of the piece's elements, in the order of its values."""
    # the box first (a TP or EP slice of the full tensor), then the flat range of that slice's elements
    # (a ZeRO / FSDP shard of a flat buffer holding it)
    if pc["box"] is not None:
        index = index[tuple(slice(a, b) for a, b in pc["box"])]
    index = index.reshape(-1)
    if pc["flat"] is not None:
        a, b = pc["flat"]
        index = index[a:b]
    return index


def assemble(pieces: list[dict], what: str = "parameters") -> tuple[dict[str, np.ndarray], list[PieceIssue]]:
    """Full tensors from pieces ({name, shape, box, flat, values, rank}; common.piece plus the rank
    that sent it), and the issues found: copies that differ, non-finite values. Raises ValueError
    if some element of a tensor was never covered (the pieces themselves are wrong)."""
    out: dict[str, np.ndarray] = {}
    owner: dict[str, np.ndarray] = {}  # per element: the rank whose copy was written, -1: none yet
    differs: dict[tuple[str, int, int], list] = {}  # (name, first rank, other rank) -> [count, largest]
    issues: list[PieceIssue] = []
    for pc in pieces:
        name, rank = pc["name"], pc.get("rank", -1)
        if name not in out:
            # in fp32 whatever the pieces were sent as: the bits are compared as fp32 below
            out[name] = np.zeros(pc["shape"], dtype=np.float32)
            owner[name] = np.full(prod(pc["shape"]), -1, dtype=np.int64)
        values = np.asarray(pc["values"], dtype=np.float32).reshape(-1)
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            issues.append(PieceIssue("not finite", what, name, (rank,), bad))
        # an index grid of the full tensor, cut as the piece was cut: each value's flat position
        pos = _positions(pc, np.arange(out[name].size).reshape(out[name].shape))
        flat, first = out[name].reshape(-1), owner[name]
        # elements some rank wrote already: compared with that first copy, never overwritten
        seen = first[pos] >= 0
        if seen.any():  # bit for bit: compare the bits, so -0.0 vs 0.0 and NaN payloads count too
            old, new = flat[pos[seen]], values[seen]
            diff = old.view(np.uint32) != new.view(np.uint32)
            # one issue per pair of ranks (the first writer, this one), counted over all their pieces
            for r in np.unique(first[pos[seen]][diff]):
                here = diff & (first[pos[seen]] == r)
                acc = differs.setdefault((name, int(r), rank), [0, 0.0])
                acc[0] += int(np.count_nonzero(here))
                gap = np.abs(old[here].astype(np.float64) - new[here])
                # every gap NaN (a NaN on one side): the largest is NaN, not nanmax's warning
                acc[1] = max(acc[1], float(np.nanmax(gap)) if np.isfinite(gap).any() else float("nan"))
        flat[pos[~seen]] = values[~seen]
        first[pos[~seen]] = rank
    issues += [PieceIssue("differs", what, n, (a, b), k, big) for (n, a, b), (k, big) in differs.items()]
    # an element no piece covers means the pieces are wrong, not the training: raised, not reported
    missing = [n for n, o in owner.items() if (o < 0).any()]
    if missing:
        raise ValueError(f"{what} not fully covered by any rank's pieces: {missing}")
    return out, issues
