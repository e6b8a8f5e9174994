"""How far a correct layout may sit from the fp32 reference, per quantity and precision; the
derivations (rounding of reordered sums, bf16's unit roundoff, AdamW) are in DERIVATIONS.md,
"The oracle's bounds".

Every layout is checked against the one-process fp32 reference (labkit/oracle/reference.py), bf16 ones
too: an oracle that shares no arithmetic with any strategy. The per-tensor gradient bound is
relative with a floor, so that a tensor whose gradient is near zero is held to the scale of the
whole gradient (the rounding it suffers comes from the magnitudes flowing through backward, not
from its own): ||g_t - g_ref,t|| <= grads * max(||g_ref,t||, sqrt(n_t / Ψ) ||g_ref||).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.config.choices import numerics
from labkit.oracle.bounds_fp8 import cast_exact, fp8_bounds

UNIT_ROUNDOFF = {"fp32": 2.0**-24, "bf16": 2.0**-8}
"""u: the largest relative error of one round-to-nearest (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., section 2.1): 2^-24 for fp32's 24 significand bits, 2^-8 for
bf16's 8."""


@dataclass(frozen=True)
class Bounds:
    """Relative bounds of one precision against the fp32 reference."""

    losses: float
    """Each step's global mean loss."""
    grad_norms: float
    """Each step's global gradient norm, before clipping, on every rank."""
    grads: float
    """Each parameter tensor's first-step reduced gradient, relative with the floor above."""
    params: float
    """The whole model's final parameters (the masters), relative L2."""


FP32 = Bounds(losses=1e-5, grad_norms=1e-5, grads=1e-5, params=1e-5)
"""A layout reorders fp32 sums (TP's partial sums, data shards, microbatches, ring attention's
blocks); two orders of an n-term sum differ by about 2·sqrt(n)·u (Higham, section 4.2), ~1.4e-6
for the b·s = 128 token rows of a weight gradient; measured: 2.5e-7 to 5e-7 per tensor against
float64, 1e-7 to 3e-6 on the final parameters. Bugs move a tensor's gradient by O(1)."""


def bounds(precision: str, layers: int, layout=None) -> Bounds:
    """The bounds of `precision` for a model of `layers` blocks (DERIVATIONS.md derives them); fp8's
    are bf16's with fp8's terms added (bounds_fp8.py), tighter on the first step's gradients where
    `layout` (a ParallelConfig) shares every fp8 cast with the reference (`cast_exact`)."""
    kind = numerics(precision)
    if not kind.mixed:
        return FP32
    if kind.fp8:
        return fp8_bounds(bounds("bf16", layers), layers, layout is not None and cast_exact(layout))
    # one bf16 rounding per tensor on the longest backward path: the embedding, two per block
    # (attention and MLP), the head and the loss's input, and the gradient's own rounding
    path = (2 * layers + 4) * UNIT_ROUNDOFF["bf16"]
    # losses 1e-3 (128 tokens' roundings average down), the whole model 2e-2 (AdamW moves an element
    # whose gradient sign bf16 flips by 2·lr): DERIVATIONS.md, "The oracle's bounds"
    return Bounds(losses=1e-3, grad_norms=path, grads=path, params=2e-2)


def tensor_errors(grads: dict, ref: dict) -> dict[str, tuple[float, float]]:
    """{name: (error, allowed scale)} per tensor: error ||g_t - g_ref,t||, scale max(||g_ref,t||,
    sqrt(n_t / Ψ) ||g_ref||); the bound holds when error <= bound * scale (NaN never does)."""
    # ||g_ref|| of the whole model, in float64
    total = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in ref.values()) ** 0.5
    psi = sum(g.size for g in ref.values())
    out = {}
    for name, want in ref.items():
        own = float(np.linalg.norm(want.astype(np.float64)))
        # what a uniform relative error over the whole gradient would put on this tensor's n_t elements
        floor = total * (want.size / psi) ** 0.5
        out[name] = (float(np.linalg.norm(grads[name].astype(np.float64) - want)), max(own, floor))
    return out


def round_to(values: np.ndarray, precision: str) -> np.ndarray:
    """fp32 values rounded to `precision` (round to nearest, ties to even, as torch's casts), as
    fp32: bf16 keeps the upper 16 bits of an fp32."""
    if not numerics(precision).mixed:
        return values.astype(np.float32)
    # in uint64: adding the rounding bias to the largest fp32 patterns would overflow 32 bits
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # the carry may round up into the exponent
    return rounded.astype(np.uint32).view(np.float32)
