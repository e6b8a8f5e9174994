"""How far a correct layout may sit from its reference, per quantity and precision; the derivations
(rounding of reordered sums, bf16's unit roundoff, AdamW, shared arithmetic) are in DERIVATIONS.md,
"The oracle's bounds".

A layout whose arithmetic one process computes (labkit/oracle/arithmetic.py) is held to the reference
in its own precision by `shared_bounds`: the reduction's rounding alone. Any other is held to the fp32
reference (fp8: the fp8 one) by `bounds`: fp32's 1e-5, bf16's roundings on each gradient's chain, fp8's
casts added (bounds_fp8.py). The per-tensor gradient bound is
relative with a floor, so that a tensor whose gradient is near zero is held to the scale of the
whole gradient (the rounding it suffers comes from the magnitudes flowing through backward, not
from its own): ||g_t - g_ref,t|| <= grads * max(||g_ref,t||, sqrt(n_t / Ψ) ||g_ref||).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from labkit.config.choices import numerics
from labkit.engines.meters.rounding import depths
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
    grads: float | dict[str, float]
    """Each parameter tensor's reduced gradient at every step, relative with the floor above: one number,
    or one per tensor (bf16: its chain's roundings)."""
    params: float
    """The whole model's final parameters (the masters), relative L2, against the reference replayed along
    the run (labkit/oracle/replay.py): the same AdamW on the same gradients, in fp32 in every precision."""
    step_grads: tuple[dict[str, float], ...] = ()
    """Per step and tensor, where the bound depends on the step's own gradients (`shared_bounds`): it
    replaces `grads`."""
    validation: float | None = None
    """data='text': the validation loss (None: `losses`'s)."""

    def grad(self, name: str, step: int = 0) -> float:
        """The gradient bound of tensor `name` at `step`."""
        if self.step_grads:
            return self.step_grads[step][name]
        return self.grads[name] if isinstance(self.grads, dict) else self.grads


FP32 = Bounds(losses=1e-5, grad_norms=1e-5, grads=1e-5, params=1e-5)
"""A layout reorders fp32 sums (TP's partial sums, data shards, microbatches, ring attention's
blocks); two orders of an n-term sum differ by about 2·sqrt(n)·u (Higham, section 4.2), ~1.4e-6
for the b·s = 128 token rows of a weight gradient; measured: 2.5e-7 to 5e-7 per tensor against
float64, 1e-7 to 3e-6 on the final parameters. Bugs move a tensor's gradient by O(1)."""


def bounds(precision: str, paths: dict[str, int] | None = None, layout=None, layers: int = 0) -> Bounds:
    """The bounds of `precision` (DERIVATIONS.md derives them). bf16: each tensor's gradient within
    paths[t]·u, paths[t] the roundings on the longest chain to it (`paths`, counted on the computation
    by engines/meters/rounding.py); the norm within the largest. fp8: bf16's with fp8's terms added
    (bounds_fp8.py: `layers` blocks of fp8 casts), none on the gradients where `layout` (a ParallelConfig)
    shares every fp8 cast with the reference (`cast_exact`)."""
    kind = numerics(precision)
    if not kind.mixed:
        return FP32
    if kind.fp8:
        return fp8_bounds(bounds("bf16", paths), layers, layout is not None and cast_exact(layout))
    if not paths:
        raise ValueError("bf16's bounds need each tensor's roundings (labkit/oracle/bounds.py `paths`)")
    u = UNIT_ROUNDOFF["bf16"]
    grads = {name: n * u for name, n in paths.items()}
    # losses 1e-3 (the tokens' roundings average down); the parameters are the fp32 masters updated by
    # the replay's AdamW from the run's own gradients, as fp32 runs': DERIVATIONS.md, "The oracle's bounds"
    return Bounds(losses=1e-3, grad_norms=max(grads.values()), grads=grads, params=FP32.params)


def paths(model, layout=None) -> dict[str, int]:
    """Per parameter: the roundings on the longest chain to its bf16 gradient — those of one process
    (`one_process`, counted on its computation) and those a layout adds (`layout_roundings`)."""
    extra = layout_roundings(layout, model.layers) if layout is not None else 0
    return {name: n + extra for name, n in one_process(model).items()}


def layout_roundings(cfg, layers: int) -> int:
    """Roundings a layout adds on a gradient's chain over one process's, each a bf16 rounding one process
    does not make: the data-parallel reduction's result rounded back into the bf16 gradients (1, engines/
    precision.py); accumulation over M microbatches in the compute dtype (up to M - 1); a tied embedding's
    two pipeline copies summed (1); and tensor parallelism's partial sums, each bf16 and summed in bf16 by
    the all-reduce or reduce-scatter, where one process rounds the whole product once: tp - 1 more per
    row-parallel output in forward (attention's and the MLP's, 2 a block) and per column-parallel input
    gradient in backward (2 a block)."""
    return 1 + (cfg.microbatches - 1) + int(cfg.pp > 1) + 4 * layers * (cfg.tp - 1)


_ONE_PROCESS: dict = {}


def one_process(model) -> dict[str, int]:
    """{parameter: roundings on the longest chain to its gradient} in one process's bf16 forward and
    backward of `model` (engines/meters/rounding.py), counted once per model config."""
    if model not in _ONE_PROCESS:
        from labkit.engines import data as batches  # torch: counted where the reference trains
        from labkit.engines.model import build_model
        from labkit.engines.precision import compute_copy

        compute = compute_copy(build_model(model, 0), "bf16")
        # two rows are enough: the chain's length is the model's depth, not the batch's
        tokens, targets = batches.batch("synthetic", 0, 0, 2, model)
        counted = depths(compute.module, lambda m: m(tokens, targets).backward())
        # the master parameters' names (the compute copy's are the same module tree)
        _ONE_PROCESS[model] = counted
    return _ONE_PROCESS[model]


def tensor_errors(grads: dict, ref: dict) -> dict[str, tuple[float, float]]:
    """{name: (error, allowed scale)} per tensor: error ||g_t - g_ref,t||, scale max(||g_ref,t||,
    sqrt(n_t / Ψ) ||g_ref||); the bound holds when error <= bound * scale (NaN never does)."""
    return {
        name: (float(np.linalg.norm(grads[name].astype(np.float64) - ref[name])), scale)
        for name, scale in scales(ref).items()
    }


def scales(ref: dict) -> dict[str, float]:
    """{name: max(||g_ref,t||, sqrt(n_t / Ψ) ||g_ref||)}: what a tensor's gradient error is relative to."""
    # ||g_ref|| of the whole model, in float64
    total = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in ref.values()) ** 0.5
    psi = sum(g.size for g in ref.values())
    # the floor: what a uniform relative error over the whole gradient would put on this tensor's n_t elements
    return {n: max(float(np.linalg.norm(g.astype(np.float64))), total * (g.size / psi) ** 0.5) for n, g in ref.items()}


def shared_bounds(held, extra: dict[str, int], general: Bounds) -> Bounds:
    """The bounds of a run whose every rounding the replayed reference `held` computes but its reduction's
    (labkit/oracle/arithmetic.py; DERIVATIONS.md, "Shared arithmetic"). Per element of a reduced gradient
    g = (1/R) Σ_s g_s over S shards (R data ranks): the run's fp32 sum and the reference's add the same S
    bf16 values in two orders, |difference| <= 2(S - 1) u32 Σ_s |g_s| / R (Higham, "Accuracy and Stability
    of Numerical Algorithms", 2nd ed., (4.4)), and the run then rounds its sum into bf16, <= u |g|; a tensor
    with `extra` roundings k (arithmetic.extra_roundings) has k more, each <= u Σ_s |g_s| / R. In L2 over a
    tensor, with spread_t = ||Σ_s |g_s| / R|| (Reference.step_spread):
        ||g_run - g_ref|| <= u ||g_ref|| + (k u + 2(S - 1) u32) spread_t,
    held relative to the tensor's scale (`scales`). The norm: the run's is the norm of its own gradients,
    within their distance of the reference's, plus fp32's rounding of n squares summed (torch's cascade sum,
    tensor by tensor, then across them and the ranks: ceil(log2 n) + 32 + T + S roundings of u32). The loss:
    each shard's is the reference's to the bit; the run and the reference add the S of them in two orders,
    2 S u32. The final masters: the same AdamW on the same gradients, fp32's bound. The validation loss is
    computed on other batch shapes than a step's: `general`'s."""
    u, u32 = UNIT_ROUNDOFF["bf16"], UNIT_ROUNDOFF["fp32"]
    S = held.shards
    steps, norm = [], 0.0
    for grads, spread in zip(held.step_grads, held.step_spread):
        scale = scales(grads)
        allowed = {
            n: u * float(np.linalg.norm(g.astype(np.float64))) + (extra.get(n, 0) * u + 2 * (S - 1) * u32) * spread[n]
            for n, g in grads.items()
        }
        steps.append({n: allowed[n] / scale[n] if scale[n] else 0.0 for n in grads})
        total = sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()) ** 0.5
        count = sum(g.size for g in grads.values())
        sums = math.ceil(math.log2(max(count, 2))) + 32 + len(grads) + S
        if total:
            norm = max(norm, sum(a * a for a in allowed.values()) ** 0.5 / total + sums * u32)
    return Bounds(
        losses=2 * S * u32,
        grad_norms=norm,
        grads=max((max(s.values()) for s in steps), default=0.0),
        params=FP32.params,
        step_grads=tuple(steps),
        validation=general.losses,
    )


def round_to(values: np.ndarray, precision: str) -> np.ndarray:
    """fp32 values rounded to `precision` (round to nearest, ties to even, as torch's casts), as
    fp32: bf16 keeps the upper 16 bits of an fp32."""
    if not numerics(precision).mixed:
        return values.astype(np.float32)
    # in uint64: adding the rounding bias to the largest fp32 patterns would overflow 32 bits
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # the carry may round up into the exponent
    return rounded.astype(np.uint32).view(np.float32)


def uniform_factor(run: dict, own: dict, bound) -> float | None:
    """c where every tensor's gradient is c·g_ref within its bound (`bound(name)`, relative to its floored
    scale, taken at c's size), else None. Each tensor's least-squares factor is g·g_ref / g_ref·g_ref."""
    factors = {}
    for n, r in own.items():
        r = r.astype(np.float64).reshape(-1)
        if float(r @ r):
            factors[n] = float(run[n].astype(np.float64).reshape(-1) @ r) / float(r @ r)
    if not factors or not all(np.isfinite(list(factors.values()))):
        return None
    c = float(np.median(list(factors.values())))
    for n, (e, scale) in tensor_errors({n: run[n] / c for n in own} if c else run, own).items():
        if not e <= bound(n) * scale:
            return None
    return c
