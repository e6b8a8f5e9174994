"""Does a run train like one process? Every check of a RunResult against the fp32 reference,
shared by tests, notebooks, the CLI and benchmarks.

`mismatches(result, ref)` lists what is wrong, each with the check that found it and a message
naming the step, rank or tensor; `assert_matches` raises if anything is. The checks, in order:

  finite           every loss, gradient norm, parameter, gradient and working-weight element
  steps            as many steps as the reference, on every rank
  float8           an fp8 layout ran in fp8: each rank's fp8 matmuls, per step, those its layout converts
  replicas         every rank holding an element holds the same bits (labkit/oracle/assembly.py),
                   every tp rank routing a token sends it to the same experts
  working weights  the weights forward reads are the masters rounded to the compute dtype
  padding          a padded vocabulary's padding rows: zero parameters, zero gradients (never in the loss)
  routing          every token the run sent to other experts than the reference is a tie within the
                   arithmetic's error (labkit/oracle/replay.py)
  gradients        every step's reduced gradient of every tensor (before clipping)
  losses           each step's global loss
  grad norms       each step's global gradient norm, on every rank
  parameters       the final masters, whole model (relative L2)
  buffers          the MoE routers' aux-loss-free biases

A run that brought its parameters back (return_params=True) brings every step's reduced gradients
too, and is held against the reference replayed along it (labkit/oracle/replay.py): one process
that computes each step's loss, norm and gradients itself but updates with the run's gradients,
so every step is one step's arithmetic, held by one step's bounds (labkit/oracle/bounds.py), and
what AdamW does with a rounding — it divides each element by its own RMS + ε, so a near-zero
element's rounding becomes an update of up to lr — is the optimizer's, the same on both sides.
A run without its gradients is held on what the first step alone can hold: its loss and norm.
The reference is the one `ref` describes (model, seed, batch, optimizer, data), computed in the run's
reference arithmetic (labkit/oracle/arithmetic.py): the run's own precision and batch split where one
process computes every rounding the run does but its reduction's (held to that rounding), else fp32
(fp8: the fp8 reference split as the layout splits it), held to the roundings of each gradient's chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from labkit.config.choices import numerics
from labkit.layout.float8 import float8_weights, fp8_weight
from labkit.oracle.bounds import Bounds, round_to, tensor_errors, uniform_factor
from labkit.oracle.float8 import float8_problems
from labkit.oracle.held import gradient_pairs, held_steps, judged, judged_first, ratio


@dataclass(frozen=True)
class Mismatch:
    check: str
    """finite | steps | replicas | float8 | working weights | padding | routing | gradients | losses |
    grad norms | parameters | buffers"""
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


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


def float8(result) -> list[Mismatch]:
    """An fp8 layout computed in fp8: every rank ran, each step, the fp8 matmuls of the layers its layout
    converts (labkit/oracle/float8.py); a run that says fp8 and computes in bf16 fails here by name."""
    return [Mismatch("float8", m) for m in float8_problems(result)]


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


def gradients(result, held, within: Bounds, show: int = 6) -> list[Mismatch]:
    """Every step's reduced gradient of every tensor against the replayed reference's (the first step's
    alone against a plain reference: `judged`), by bounds.py's per-tensor bound."""
    out: list[Mismatch] = []
    for step, (run, own) in enumerate(gradient_pairs(result, held)):
        missing = sorted(set(own) - set(run))
        if missing:
            return [Mismatch("gradients", f"step {step}'s gradients missing from the run: {missing}")]
        # error over its floored scale, over its own bound: > 1 fails (NaN too)
        over = {n: ratio(e, scale) / within.grad(n, step) for n, (e, scale) in tensor_errors(run, own).items()}
        bad = [n for n, x in over.items() if _over(x, 1.0)]
        # the furthest off first (relative to its scale), NaN worst of all: the `show` listed matter most
        bad.sort(key=lambda n: -np.nan_to_num(over[n] * within.grad(n, step), nan=np.inf))
        c = uniform_factor(run, own, partial(within.grad, step=step)) if len(bad) == len(own) else None
        if c is not None:  # one factor on every tensor: a division, a count or a scale, not a tensor's bug
            out.append(
                Mismatch(
                    "gradients",
                    f"every tensor's step {step} reduced gradient is {c:.4g} times the reference's "
                    f"(all {len(own)} within their bounds of that multiple)",
                )
            )
        out += [
            Mismatch(
                "gradients",
                f"{n}: step {step}'s reduced gradient is {over[n] * within.grad(n, step):.3g} (relative, floored) "
                f"from the reference's > {within.grad(n, step):.3g}",
            )
            for n in bad[:show]
        ] + (
            [Mismatch("gradients", f"... and {len(bad) - show} more tensor(s) at step {step}")]
            if len(bad) > show
            else []
        )
        if bad:  # the first step a gradient goes wrong is where to look; later ones follow from it
            return out
    return out


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


def losses(result, held, bound: float) -> list[Mismatch]:
    n = held_steps(result, held)
    errs = loss_errors(result.losses[:n], held.losses[:n])
    if not any(_over(e, bound) for e in errs):
        return []
    return [
        Mismatch(
            "losses",
            f"the loss differs from the reference's beyond {bound:g} at "
            + _steps(errs, lambda s: _over(errs[s], bound))
            + f" (run {result.losses}, reference {held.losses})",
        )
    ]


def validation(result, held, bound: float) -> list[Mismatch]:
    """data='text': the trained model's loss on the held-out windows against the replayed reference's
    (the same parameters up to the optimizers' rounding; against a plain reference, nothing: after an
    update the optimizer has amplified a rounding, replay.py)."""
    if result.validation_loss is None or held.validation_loss is None or held.replayed is None:
        return []
    err = loss_errors([result.validation_loss], [held.validation_loss])[0]
    if not _over(err, bound):
        return []
    return [
        Mismatch(
            "losses",
            f"the validation loss {result.validation_loss:.6g} differs from the reference's "
            f"{held.validation_loss:.6g} by {err:.3g} (relative) > {bound:g}",
        )
    ]


def grad_norms(result, held, bound: float) -> list[Mismatch]:
    """On every rank: AdamW is nearly blind to the scale of its gradients, so a missing average
    or a doubled shard shows here and in clipping, hardly in the parameters."""
    n = held_steps(result, held)
    out = []
    for rk in result.ranks:
        # every rank computes the global norm after its reduction: each must agree with the reference's
        errs = loss_errors(rk.grad_norms[:n], held.grad_norms[:n])
        if any(_over(e, bound) for e in errs):
            out.append(
                Mismatch(
                    "grad norms",
                    f"rank {rk.rank}'s gradient norm differs from the reference's beyond {bound:g} at "
                    + _steps(errs, lambda s, errs=errs: _over(errs[s], bound))
                    + f" (rank {rk.grad_norms}, reference {held.grad_norms})",
                )
            )
    return out


def parameters(result, held, bound: float) -> list[Mismatch]:
    """The final masters against the replayed reference's: the same AdamW on the same gradients, so
    they differ by the optimizer's own rounding alone (bounds.py). Not held against a plain
    reference: after an update the optimizer has amplified a rounding (replay.py)."""
    if result.params is None or held.replayed is None:
        return []
    err = model_error(result.params, held.params)
    if not _over(err, bound):
        return []
    perr = param_errors(result.params, held.params)
    # the three tensors furthest off, NaN first: where to look
    worst = sorted(perr, key=lambda k: -perr[k] if np.isfinite(perr[k]) else -np.inf)[:3]
    return [
        Mismatch(
            "parameters",
            f"the final parameters differ from the reference by {err:.3g} (relative L2 of the whole "
            f"model) > {bound:g}; worst tensors: " + ", ".join(f"{k} {perr[k]:.3g}" for k in worst),
        )
    ]


def buffers(result, held, bound: float) -> list[Mismatch]:
    """Each buffer training changes (an MoE router's aux-loss-free bias) against the replayed reference's,
    by its own relative L2: a bias updated from one rank's loads rather than the global batch's lands
    some γ off (tests/test_moe_fine.py feeds it one). The bias is a step function of the routing, and the
    replay routes as the run routed where the two tie: bf16 runs are held as fp32 ones. Against a plain
    reference only after one step in fp32: the first update's loads come from the same weights on both sides
    (in bf16 a tie may route apart, which only the replay follows)."""
    plain_ok = len(held.losses) == result.steps == 1 and not numerics(result.config.precision).mixed
    if result.buffers is None or not held.buffers or (held.replayed is None and not plain_ok):
        return []
    missing = sorted(set(held.buffers) - set(result.buffers))
    if missing:
        return [Mismatch("buffers", f"buffers missing from the run: {missing}")]
    errs = param_errors(result.buffers, held.buffers)
    return [
        Mismatch("buffers", f"{n}: {e:.3g} (relative L2) from the reference's > {bound:g}")
        for n, e in errs.items()
        if _over(e, bound)
    ]


def mismatches(result, ref, within: Bounds | None = None) -> list[Mismatch]:
    """Everything in which `result` does not train like `ref`, the fp32 reference of the same
    model, seed, steps and global batch (bf16 runs too: labkit/oracle/bounds.py). A run with its
    parameters back (return_params=True) is held at every step against the reference replayed along
    it (labkit/oracle/replay.py); one without, on its losses, norms, finiteness and steps, the steps
    after the first only where ... (`judged`)."""
    held, b = judged(result, ref, within)
    # in the module docstring's order: the most basic failure is named first
    found = finite(result) + steps(result, ref)
    found += [Mismatch("replicas", str(i)) for i in result.piece_issues if i.kind == "differs"]
    found += float8(result) + working_weights(result) + padding(result) + routing(held)
    found += gradients(result, held, b)
    first = judged_first(result, ref)  # FSDP2 in bf16: its first step's arithmetic is one process's
    found += gradients(result, *first) if first is not None else []
    found += (
        losses(result, held, b.losses)
        + validation(result, held, b.losses if b.validation is None else b.validation)
        + grad_norms(result, held, b.grad_norms)
    )
    return found + parameters(result, held, b.params) + buffers(result, held, b.params)


def routing(held) -> list[Mismatch]:
    """Tokens the run sent to experts that the arithmetic's error cannot explain (replay.py `legitimate`)."""
    refused = getattr(held.replayed, "refused", None) or []
    if not refused:
        return []
    worst = max(refused, key=lambda t: t["excess"])
    return [
        Mismatch(
            "routing",
            f"{len(refused)} token(s) went to other experts than the reference's beyond the error of the "
            f"logits; the worst: step {worst['step']}, layer {worst['layer']}, row {worst['row']}, position "
            f"{worst['position']}: run {worst['run']}, reference {worst['own']}, "
            f"{worst['excess']:.3g} error bounds apart",
        )
    ]


def margins(result, ref, within: Bounds | None = None) -> dict[str, float]:
    """How close `result` comes to each bound: the worst error over its bound, per check that
    has a bound (losses, grad norms, gradients, parameters); <= 1 passes, NaN fails. What a
    benchmark reports beside pass/fail, e.g. how far GPU arithmetic sits inside the CPU-derived
    bounds (benchmarks/gpu_layouts.py). 'flips': the tokens routed as the run routed (ties)."""
    held, b = judged(result, ref, within)
    # NaN is the worst margin of all: it fails
    worst = lambda xs: float(max(xs, key=lambda x: np.inf if np.isnan(x) else x)) if xs else 0.0
    n = held_steps(result, held)
    out = {
        "losses": worst(loss_errors(result.losses[:n], held.losses[:n])) / b.losses,
        "grad norms": worst([e for rk in result.ranks for e in loss_errors(rk.grad_norms[:n], held.grad_norms[:n])])
        / b.grad_norms,
    }
    pairs = gradient_pairs(result, held)
    if pairs:
        out["gradients"] = worst(
            [
                ratio(e, scale) / b.grad(n, step)
                for step, (run, own) in enumerate(pairs)
                for n, (e, scale) in tensor_errors(run, own).items()
            ]
        )
    if result.params is not None and held.replayed is not None:
        out["parameters"] = model_error(result.params, held.params) / b.params
    if held.replayed is not None:
        out["flips"] = sum(sum(f.values()) for f in held.replayed.flips)
    return out


def assert_matches(result, ref, within: Bounds | None = None) -> None:
    """Raise AssertionError listing every mismatch of `result` with the fp32 reference `ref`."""
    found = mismatches(result, ref, within)
    if found:
        lines = "\n".join(f"  {m}" for m in found)
        raise AssertionError(f"the run does not train like the reference ({len(found)} mismatch(es)):\n{lines}")
