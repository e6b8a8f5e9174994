"""Does a run train like one process? Every check of a RunResult against the fp32 reference,
shared by tests, notebooks, the CLI and benchmarks.

`mismatches(result, ref)` lists what is wrong, each with the check that found it and a message
naming the step, rank or tensor; `assert_matches` raises if anything is. The checks, in order:

  finite           every loss, gradient norm, parameter, gradient and working-weight element
  steps            as many steps as the reference, on every rank
  replicas         every rank holding an element holds the same bits (labkit/oracle/assembly.py)
  working weights  the weights forward reads are the masters rounded to the compute dtype
  padding          a padded vocabulary's padding rows: zero parameters, zero gradients (never in the loss)
  gradients        the first step's reduced gradient of every tensor (before clipping)
  losses           each step's global loss
  grad norms       each step's global gradient norm, on every rank
  parameters       the final masters, whole model (relative L2)

Gradient parity per tensor is where an unreduced bucket, a missing division or a shifted shard
shows; the later steps are held by the losses, the norms and the whole model, because AdamW
(which divides each gradient element by its own RMS) turns the rounding of a near-zero gradient
into an update of ~lr: one process that merely splits its batch in two moves a zero-initialised
LayerNorm bias by 2.7e-4 of its own norm after 2 steps, while the whole model moves by 5e-7.
The bounds (labkit/oracle/bounds.py) are against the fp32 reference in both precisions; an fp8
layout's are against the fp8 reference that splits its batch as it does (bounds_fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.config.choices import numerics
from labkit.layout.float8 import float8_weights, fp8_weight
from labkit.oracle.bounds import Bounds, bounds, round_to, tensor_errors
from labkit.oracle.bounds_fp8 import reference_problems

# the whole model's bounds (DERIVATIONS.md, "The oracle's bounds"): fp32's ~20x above what reordered
# sums do (model_error); bf16's over the 3.5e-3 to 1.12e-2 its layouts measured after 3 steps
FP32_RTOL = 1e-5
BF16_RTOL = 2e-2


@dataclass(frozen=True)
class Mismatch:
    check: str
    """finite | steps | replicas | working weights | padding | gradients | losses | grad norms | parameters"""
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


def rtol_for(precision: str) -> float:
    """The whole-model parameter bound of `precision` (bounds.Bounds.params)."""
    return BF16_RTOL if numerics(precision).mixed else FP32_RTOL


def loss_errors(losses, ref_losses) -> list[float]:
    """Relative error of each step's loss (NaN stays NaN)."""
    return [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]


def param_errors(params: dict, ref_params: dict) -> dict[str, float]:
    """Relative L2 error of each parameter tensor, ||p - p_ref|| / ||p_ref|| (for diagnosis:
    which tensor a failing run got wrong)."""
    missing = set(ref_params) - set(params)
    if missing:
        raise AssertionError(f"parameters missing from the run: {sorted(missing)}")
    return {
        # a reference of zeros (an expert no token reached) gives a huge ratio, never a ZeroDivisionError
        k: float(np.linalg.norm(params[k] - ref_params[k]) / max(np.linalg.norm(ref_params[k]), 1e-30))
        for k in ref_params
    }


def model_error(params: dict, ref_params: dict) -> float:
    """Relative L2 error of the whole parameter vector: ||θ - θ_ref|| / ||θ_ref||. Why the whole
    model and not per tensor after several steps: the module docstring (AdamW). A 1% learning-rate
    error moves TINY's whole model by 9.4e-4: the fp32 bound of 1e-5 sits ~20x below it and
    ~20x above what reordering sums does."""
    missing = set(ref_params) - set(params)
    if missing:
        raise AssertionError(f"parameters missing from the run: {sorted(missing)}")
    # in float64: millions of tiny squared differences, which fp32 sums would round away
    diff = sum(float(np.sum((params[k].astype(np.float64) - ref_params[k]) ** 2)) for k in ref_params)
    norm = sum(float(np.sum(ref_params[k].astype(np.float64) ** 2)) for k in ref_params)
    return (diff / norm) ** 0.5


def _over(err: float, bound: float) -> bool:
    return not err <= bound  # NaN is over every bound


def _steps(xs, bad) -> str:
    return ", ".join(f"step {s}: {x:.3g}" for s, x in enumerate(xs) if bad(s))


def finite(result) -> list[Mismatch]:
    out = []
    bad = [s for s, x in enumerate(result.losses) if not np.isfinite(x)]
    if bad:
        out.append(Mismatch("finite", f"the loss is not finite at step(s) {bad}: {result.losses}"))
    for rk in result.ranks:
        # each rank's own numbers too: one bad rank can hide inside the combined loss
        for what, xs in (("loss share", rk.losses), ("gradient norm", rk.grad_norms)):
            bad = [s for s, x in enumerate(xs) if not np.isfinite(x)]
            if bad:
                out.append(Mismatch("finite", f"rank {rk.rank}'s {what} is not finite at step(s) {bad}: {xs}"))
    # what the assembly found non-finite in the returned pieces (RunResult.piece_issues)
    out += [Mismatch("finite", str(i)) for i in result.piece_issues if i.kind == "not finite"]
    return out


def steps(result, ref) -> list[Mismatch]:
    want = len(ref.losses)
    out = []
    # a run that stopped early would pass every other check on the steps it has
    if result.steps != want or len(result.losses) != want:
        out.append(Mismatch("steps", f"{len(result.losses)} losses for {result.steps} steps; the reference has {want}"))
    for rk in result.ranks:
        for what, xs in (("losses", rk.losses), ("gradient norms", rk.grad_norms)):
            if len(xs) != want:
                out.append(Mismatch("steps", f"rank {rk.rank} reported {len(xs)} {what}, not {want}"))
    return out


def working_weights(result) -> list[Mismatch]:
    """The weights forward reads (GradSync.compute_pieces) equal the masters rounded to the compute
    dtype, bit for bit: a stale gather or a working copy not refreshed after the update shows here."""
    # without return_params there are no pieces: the checks that need them have nothing to read
    if result.compute is None or result.params is None:
        return []
    out = []
    gathered8 = fp8_gathered(result)
    for name, w in result.compute.items():
        want = round_to(result.params[name], result.config.precision)
        if name in gathered8:  # FSDP's float8 all-gather: fp8(w·s) / s, s from the whole bf16 tensor
            want = fp8_weight(want)
        # compared as bits: identical NaNs are equal, +0 and -0 are not; the copy must be exactly the rounding
        differ = int(np.count_nonzero(w.view(np.uint32) != want.view(np.uint32)))
        if differ:
            gap = float(np.nanmax(np.abs(w.astype(np.float64) - want)))
            out.append(
                Mismatch(
                    "working weights",
                    f"{name}: {differ} of {w.size} element(s) differ from the masters rounded to "
                    f"{result.config.precision} (largest |difference| {gap:.3g})",
                )
            )
    return out


def fp8_gathered(result) -> set[str]:
    """The weights a run gathers in fp8 (our ZeRO-3 / FSDP units under fp8, tensorwise: layout/flat.py
    FlatLayout.fp8), whose working copies are their fp8 casts."""
    cfg = result.config
    if not (numerics(cfg.precision).fp8 and cfg.fp8_scaling.gathers_fp8 and cfg.sharded.params):
        return set()
    return set(float8_weights((n, v.shape) for n, v in result.params.items()))


def gradients(result, ref, bound: float, show: int = 6) -> list[Mismatch]:
    """The first step's reduced gradient of every tensor against the reference's (bounds.py)."""
    if result.grads is None or not ref.first_grads:
        return []
    missing = sorted(set(ref.first_grads) - set(result.grads))
    if missing:
        return [Mismatch("gradients", f"first-step gradients missing from the run: {missing}")]
    errs = tensor_errors(result.grads, ref.first_grads)
    # error over its floored scale (bounds.tensor_errors): a zero scale is exact with no error, else inf
    ratio = {n: e / scale if scale else (0.0 if e == 0 else np.inf) for n, (e, scale) in errs.items()}
    bad = [n for n, (e, scale) in errs.items() if _over(e, bound * scale)]
    # the worst first, NaN worst of all: the `show` listed are the ones that matter most
    bad.sort(key=lambda n: -np.nan_to_num(ratio[n], nan=np.inf))
    return [
        Mismatch(
            "gradients",
            f"{n}: the first step's reduced gradient is {ratio[n]:.3g} (relative, floored) "
            f"from the reference's > {bound:.3g}",
        )
        for n in bad[:show]
    ] + ([Mismatch("gradients", f"... and {len(bad) - show} more tensor(s)")] if len(bad) > show else [])


def padding(result) -> list[Mismatch]:
    """A padded vocabulary's padding rows (ModelConfig.vocab_divisible_by) never take part: they start
    at zero and their logits are masked out of the loss, so their gradient is exactly zero and they
    stay zero through every update. A non-zero element is a mask that leaked into the model."""
    out = []
    for kind, tensors in (result.padding or {}).items():
        for name, rows in tensors.items():
            if np.count_nonzero(rows):
                out.append(
                    Mismatch(
                        "padding",
                        f"{kind} {name}: {np.count_nonzero(rows)} element(s) of the padding rows "
                        f"[{result.model.vocab}:) are not zero (largest |x| {float(np.nanmax(np.abs(rows))):.3g})",
                    )
                )
    return out


def losses(result, ref, bound: float) -> list[Mismatch]:
    errs = loss_errors(result.losses, ref.losses)
    if not any(_over(e, bound) for e in errs):
        return []
    return [
        Mismatch(
            "losses",
            f"the loss differs from the reference's beyond {bound:g} at "
            + _steps(errs, lambda s: _over(errs[s], bound))
            + f" (run {result.losses}, reference {ref.losses})",
        )
    ]


def grad_norms(result, ref, bound: float) -> list[Mismatch]:
    """On every rank: AdamW is nearly blind to the scale of its gradients, so a missing average
    or a doubled shard shows here and in clipping, hardly in the parameters."""
    out = []
    for rk in result.ranks:
        # every rank computes the global norm after its reduction: each must agree with the reference's
        errs = loss_errors(rk.grad_norms, ref.grad_norms)
        if any(_over(e, bound) for e in errs):
            out.append(
                Mismatch(
                    "grad norms",
                    f"rank {rk.rank}'s gradient norm differs from the reference's beyond {bound:g} at "
                    + _steps(errs, lambda s, errs=errs: _over(errs[s], bound))
                    + f" (rank {rk.grad_norms}, reference {ref.grad_norms})",
                )
            )
    return out


def parameters(result, ref, bound: float) -> list[Mismatch]:
    if result.params is None:
        return []
    err = model_error(result.params, ref.params)
    if not _over(err, bound):
        return []
    perr = param_errors(result.params, ref.params)
    # the three tensors furthest off, NaN first: where to look
    worst = sorted(perr, key=lambda k: -perr[k] if np.isfinite(perr[k]) else -np.inf)[:3]
    return [
        Mismatch(
            "parameters",
            f"the final parameters differ from the reference by {err:.3g} (relative L2 of the whole "
            f"model) > {bound:g}; worst tensors: " + ", ".join(f"{k} {perr[k]:.3g}" for k in worst),
        )
    ]


def buffers(result, ref, bound: float) -> list[Mismatch]:
    """Each buffer training changes (an MoE router's aux-loss-free bias) against the reference's, by
    its own relative L2: a bias updated from one rank's loads rather than the global batch's lands
    some γ off (tests/test_moe_fine.py feeds it one). fp32 runs only: the bias is a step function of
    the routing (a top-k), and bf16's rounding moves some tokens to other experts than the fp32
    reference's, so no bound derived from rounding holds it; a bf16 run's copies are still held equal
    across ranks (the replicas check), which a bias updated from one rank's loads fails."""
    if result.buffers is None or not ref.buffers or numerics(result.config.precision).mixed:
        return []
    missing = sorted(set(ref.buffers) - set(result.buffers))
    if missing:
        return [Mismatch("buffers", f"buffers missing from the run: {missing}")]
    errs = param_errors(result.buffers, ref.buffers)
    return [
        Mismatch("buffers", f"{n}: {e:.3g} (relative L2) from the reference's > {bound:g}")
        for n, e in errs.items()
        if _over(e, bound)
    ]


def mismatches(result, ref, within: Bounds | None = None) -> list[Mismatch]:
    """Everything in which `result` does not train like `ref`, the fp32 reference of the same
    model, seed, steps and global batch (bf16 runs too: labkit/oracle/bounds.py). A run without
    return_params is checked on what it returned: losses, norms, finiteness, steps."""
    if numerics(result.config.precision).fp8:
        wrong = reference_problems(result.config, ref)
        if wrong:
            raise ValueError(wrong[0])
    elif numerics(ref.precision).mixed:
        raise ValueError(
            f"the oracle is the fp32 reference (reference(..., precision='fp32')), not {ref.precision!r}: "
            "bf16 runs are held to bounds derived against it (labkit/oracle/bounds.py)"
        )
    # by precision and depth: bf16's bounds grow with the layers a gradient passes through, (2L + 4)·u
    b = within or bounds(result.config.precision, result.model.layers, result.config)
    # in the module docstring's order: the most basic failure is named first
    found = finite(result) + steps(result, ref)
    found += [Mismatch("replicas", str(i)) for i in result.piece_issues if i.kind == "differs"]
    found += working_weights(result) + padding(result)
    found += gradients(result, ref, b.grads)
    found += losses(result, ref, b.losses) + grad_norms(result, ref, b.grad_norms)
    return found + parameters(result, ref, b.params) + buffers(result, ref, b.params)


def margins(result, ref, within: Bounds | None = None) -> dict[str, float]:
    """How close `result` comes to each bound: the worst error over its bound, per check that
    has a bound (losses, grad norms, gradients, parameters); <= 1 passes, NaN fails. What a
    benchmark reports beside pass/fail, e.g. how far GPU arithmetic sits inside the CPU-derived
    bounds (benchmarks/gpu_layouts.py)."""
    b = within or bounds(result.config.precision, result.model.layers, result.config)
    # NaN is the worst margin of all: it fails
    worst = lambda xs: float(max(xs, key=lambda x: np.inf if np.isnan(x) else x)) if xs else 0.0
    out = {
        "losses": worst(loss_errors(result.losses, ref.losses)) / b.losses,
        "grad norms": worst([e for rk in result.ranks for e in loss_errors(rk.grad_norms, ref.grad_norms)])
        / b.grad_norms,
    }
    if result.grads is not None and ref.first_grads:
        errs = tensor_errors(result.grads, ref.first_grads).values()
        out["gradients"] = worst([e / scale if scale else (0.0 if e == 0 else np.inf) for e, scale in errs]) / b.grads
    if result.params is not None:
        out["parameters"] = model_error(result.params, ref.params) / b.params
    return out


def assert_matches(result, ref, within: Bounds | None = None) -> None:
    """Raise AssertionError listing every mismatch of `result` with the fp32 reference `ref`."""
    found = mismatches(result, ref, within)
    if found:
        lines = "\n".join(f"  {m}" for m in found)
        raise AssertionError(f"the run does not train like the reference ({len(found)} mismatch(es)):\n{lines}")
