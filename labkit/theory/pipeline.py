"""Pipeline bubble formulas (GPipe: Huang et al. 2019; interleaved: Narayanan et al., SC 2021, 2.2)."""
from __future__ import annotations


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage: (p - 1) / (v·m + p - 1) — GPipe and 1F1B (v = 1) and
    interleaved 1F1B with v chunks per rank. 0 without a pipeline."""
    if p <= 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)
