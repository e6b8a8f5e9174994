"""The bounds of an fp8 layout against the one-process fp8 reference (DERIVATIONS.md, "The oracle's
bounds", fp8): the bf16 bounds (bounds.py; an fp8 layout rounds in bf16 everywhere outside its
matmuls) with fp8's own terms added. Kept apart so that a rework of the bf16 bounds carries over:
`fp8_bounds(base, ...)` takes them as its argument.

What an fp8 cast can do to two runs (Micikevicius et al., "FP8 Formats for Deep Learning", 2022,
table 1: e4m3 has m = 3 mantissa bits, e5m2 has m = 2): a value in [2^e, 2^(e+1)) is rounded to a
grid of step 2^(e-m); with magnitudes log-uniform inside a binade the rounding error's relative RMS
is r = 2^-m·sqrt(3 / (8 ln 2)) / sqrt(12) (e4m3 0.0265, e5m2 0.0531), and two runs whose casts of
a tensor round independently differ by sqrt(2)·r. That is the most a correct layout can differ by
at one cast: a cast whose input differs by a relative η << step flips an element with probability
η / step (sqrt(η·step) in RMS), and at worst every element rounds independently. The scale itself
(max / amax in float64, rounded to fp32: 2^-24) is exact to within fp32's rounding when the amax is
the whole tensor's; an amax from part of the tensor is a different scale, i.e. a different grid:
what the working-weights check sees bit for bit, and a first-step gradient of a cast-exact layout
(below) at fp8's size, far above its bound.
"""

from __future__ import annotations

import math
from dataclasses import replace

from labkit.layout.float8 import MANTISSA

CASTS_PER_BLOCK = {"e4m3": 8, "e5m2": 4}
"""fp8 casts in series on a gradient's path through one block: forward, the inputs and weights of
the attention's projections and of its output projection, of the MLP's first and second layer
(2 sublayers x 2 layers in series x 2 operands, e4m3); backward, the output gradient of each of the
4 (e5m2). Parallel layers (wq, wk, wv; gate, up) sit on one step of the path."""
TOKENS, LOG_VOCAB, LOGIT = 128, math.log(128), 0.5
"""The test models' b·s tokens per step, ln V of their vocabulary and their logits' size at init, as
the bf16 loss bound takes them (DERIVATIONS.md: weights N(0, 0.02) on unit-RMS normed inputs)."""


def rounding_rms(fmt: str) -> float:
    """r: the relative RMS of one round-to-nearest onto fmt's grid (magnitudes log-uniform in a binade)."""
    return 2.0 ** -MANTISSA[fmt] * math.sqrt(3 / (8 * math.log(2))) / math.sqrt(12)


def decorrelated(fmt: str) -> float:
    """sqrt(2)·r: two independent roundings of one tensor, relative RMS of their difference."""
    return math.sqrt(2) * rounding_rms(fmt)


def path(layers: int, forward_only: bool = False) -> float:
    """The relative RMS that every fp8 cast on the path rounding independently puts on a quantity, the
    casts' differences independent (added in quadrature): the backward path's (a first-step gradient,
    a norm) or the forward one's (the logits)."""
    e5m2 = 0 if forward_only else CASTS_PER_BLOCK["e5m2"]
    return math.sqrt(layers * (CASTS_PER_BLOCK["e4m3"] * decorrelated("e4m3") ** 2 + e5m2 * decorrelated("e5m2") ** 2))


def cast_exact(layout) -> bool:
    """Whether every fp8 cast of a layout's first step sees the reference's input and scale (a
    ParallelConfig: fp8_bounds says which do). The reference splits its batch as the layout does
    (labkit/oracle/arithmetic.py)."""
    return layout.tp == 1 and layout.cp == 1 and not layout.torch_impl


def fp8_bounds(base, layers: int, exact: bool):
    """The bounds of an fp8 layout: `base`, the bf16 bounds of the same model (bounds.Bounds, per tensor),
    plus fp8's. The oracle replays the run (labkit/oracle/replay.py): at every step the reference computes
    at the parameters the run's own gradients led to, so what holds the first step holds every step.

    exact: the layout's every fp8 cast sees the reference's very input and scale (data-parallel and
    pipeline splits, which the reference's shards and microbatches share; FSDP's fp8 all-gather with the
    whole tensor's amax): its gradients and norms keep base's bounds, fp8 adding nothing there. Otherwise
    (TP's partial sums rounded per rank before a cast; FSDP2 casting its fp32 shard where the reference
    casts bf16) every cast may round independently: `path` on each.
    losses: CE moves by at most 2·max|δz| per token (bounds.py's argument), δz <= path(forward)·|z|,
    averaged down over the tokens: 2·path·|z| / (sqrt(b·s)·ln V), on top of base's.
    params: the replay's AdamW takes the run's own gradients, so the masters differ by the optimizer's
    rounding alone, as in every precision: base's."""
    add = 0.0 if exact else path(layers)
    grads = {n: g + add for n, g in base.grads.items()} if isinstance(base.grads, dict) else base.grads + add
    loss = 2 * path(layers, forward_only=True) * LOGIT / (math.sqrt(TOKENS) * LOG_VOCAB)
    return replace(base, losses=base.losses + loss, grad_norms=base.grad_norms + add, grads=grads)
