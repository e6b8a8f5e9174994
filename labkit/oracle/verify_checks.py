"""The checks of Lab.verify: what the ranks sent (engines/verify.py) against `build()` alone.

In the order a bug shows first (`CHECKS`), so the report can lead with the earliest:

  coverage            every parameter of build() is on some rank, every rank's parameter is one of build()'s
  plan                no parallelize_module plan entry that selects no module (torch warns, and goes on)
  finite              no NaN or inf in any tensor any rank sent
  initial replicas    right after parallelize, every copy of an element holds the same bits (assembly.py)
  initial             ... and the whole tensor equals build()'s exactly (a per-rank init shows here)
  gradient replicas   every step's gradients: every copy the same bits
  gradients           each tensor's gradient at every step within bounds.py's per-tensor bound, against
                      the reference replayed along the run (verify.py)
  loss replicas       the ranks of one data slice report the same loss
  losses              each step's loss (the mean over data slices) within the loss bound
  parameter replicas  the final parameters: every copy the same bits
  parameters          the final parameters, whole model (relative L2), as checks.parameters

A uniform factor: where every gradient is the reference's times one number c (2: summed over two
ranks where it should be averaged; k: a loss not divided by its k accumulation steps), the report
says c rather than listing every tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from labkit.oracle.assembly import assemble
from labkit.oracle.bounds import Bounds, round_to, tensor_errors
from labkit.oracle.checks import loss_errors, model_error

CHECKS = (
    "coverage",
    "plan",
    "finite",
    "initial replicas",
    "initial",
    "gradient replicas",
    "gradients",
    "loss replicas",
    "losses",
    "parameter replicas",
    "parameters",
)

FACTOR_TOL = 1e-3
"""How alike the per-tensor factors must be (relative), and how small each tensor's residual off
the line c·g_ref, to call a gradient error uniform: a bug's factor is exact up to rounding (~1e-7),
while two different bugs give factors that differ at O(1)."""


@dataclass(frozen=True)
class Finding:
    """One thing wrong: the check that found it, the tensor (or 'loss', or a plan key), and where."""

    check: str
    tensor: str
    message: str
    step: int | None = None
    ranks: tuple[int, ...] = ()
    error: float = float("nan")
    bound: float = float("nan")

    def __str__(self) -> str:
        return f"[{self.check}] {self.tensor}: {self.message}"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (a zero b: the absolute norm)."""
    d = float(np.linalg.norm(a.astype(np.float64) - b))
    n = float(np.linalg.norm(b.astype(np.float64)))
    return d / n if n else d


def coverage(ref: dict, reports: list[dict]) -> list[Finding]:
    held = {p["name"] for r in reports for p in r["initial"]}
    out = [
        Finding("coverage", n, "exists on no rank after parallelize (build() has it)")
        for n in ref["initial"]
        if n not in held
    ]
    for r in reports:
        out += [
            Finding(
                "coverage",
                n,
                f"rank {r['rank']} holds it, but build() has no parameter of that name",
                ranks=(r["rank"],),
            )
            for n in r["unknown"]
        ]
    return out


def plan(reports: list[dict]) -> list[Finding]:
    """parallelize_module's warning for a plan key that resolves to no submodule (torch's
    distributed/tensor/parallel/api.py), once per key."""
    keys: dict[str, list] = {}
    for r in reports:
        for w in r["warnings"]:
            # torch names what is left of the key where matching stopped, and the module it looked in
            m = re.search(r"plan key '([^']*)' could not be resolved.*? in module (\w+)", w, re.S)
            if m:
                keys.setdefault(m.group(1), [m.group(2), []])[1].append(r["rank"])
    return [
        Finding(
            "plan",
            k,
            f"this parallelize_module plan entry selects no module (no submodule matches it in a {where}): "
            "torch skipped it",
            ranks=tuple(rs),
        )
        for k, (where, rs) in keys.items()
    ]


def _issue(i) -> str:
    """A PieceIssue said without its tensor's name (the Finding carries it)."""
    if i.kind == "differs":
        a, b = i.ranks
        return (
            f"rank {b}'s copy differs from rank {a}'s in {i.elements} element(s) (largest |difference| {i.largest:.3g})"
        )
    return f"{i.elements} non-finite element(s) on rank {i.ranks[0]} ({i.what})"


def gathered(reports: list[dict], what: str, label: str, step: int | None = None) -> tuple[dict, dict, list[Finding]]:
    """Every rank's copies of `what` assembled by name: (full tensors, dtypes, findings); 'grads' at `step`."""
    pieces = [p for r in reports for p in (r[what] if step is None else r[what][step])]
    full, issues = assemble(pieces, label)
    dtypes = {p["name"]: p["dtype"] for p in pieces}
    check = {"initial": "initial replicas", "grads": "gradient replicas", "final": "parameter replicas"}[what]
    found = [Finding(check if i.kind == "differs" else "finite", i.name, _issue(i), step, i.ranks) for i in issues]
    return full, dtypes, found


def step_gradients(reports: list[dict], steps: int) -> list[dict]:
    """The run's gradients of every step, full tensors by name (what the reference replays)."""
    return [gathered(reports, "grads", "gradients", s)[0] for s in range(steps)]


def repeated(value: np.ndarray, world: int) -> str:
    """' (its k blocks along dim d are identical: ...)' when the tensor is one block repeated, as
    when every rank initialises its shard from the same seed; else ''."""
    for d in {0, value.ndim - 1} if value.ndim else ():
        for k in range(world, 1, -1):
            if value.shape[d] % k == 0:
                blocks = np.split(value, k, axis=d)
                if all(np.array_equal(b, blocks[0]) for b in blocks[1:]):
                    return (
                        f" (its {k} blocks along dim {d} are identical: every rank initialised its shard the same way)"
                    )
    return ""


def initial(full: dict, dtypes: dict, ref: dict, world: int) -> tuple[dict, list[Finding]]:
    """Each tensor right after parallelize against build()'s, exactly (rounded to the rank's dtype)."""
    errs, out = {}, []
    for n, want in ref["initial"].items():
        if n not in full:
            continue
        want = round_to(want, "bf16") if dtypes[n] == "bfloat16" else want
        errs[n] = _rel(full[n], want)
        if full[n].shape != want.shape:
            out.append(Finding("initial", n, f"has shape {full[n].shape} after parallelize, {want.shape} in build()"))
        elif not np.array_equal(full[n], want):
            k = int(np.count_nonzero(full[n] != want))
            out.append(
                Finding(
                    "initial",
                    n,
                    f"{k} of {want.size} element(s) differ from build()'s right after parallelize "
                    f"(relative L2 {errs[n]:.3g}; they must be equal){repeated(full[n], world)}",
                    error=errs[n],
                    bound=0.0,
                )
            )
    return errs, out


def holders(reports: list[dict], what: str) -> dict[str, tuple[int, ...]]:
    """The ranks that sent each tensor (the first step's, for 'grads')."""
    out: dict[str, set[int]] = {}
    for r in reports:
        for p in r[what][0] if what == "grads" else r[what]:
            out.setdefault(p["name"], set()).add(r["rank"])
    return {n: tuple(sorted(rs)) for n, rs in out.items()}


def gradients(steps: list[dict], ref: dict, within: Bounds, held: dict | None = None) -> tuple[dict, list[Finding]]:
    """Each tensor's gradient at every step against the replayed reference's (bounds.tensor_errors:
    relative, floored by the whole gradient's scale); `held`: the ranks holding each, named in a finding.
    Returns each tensor's worst error over its floored scale, and the findings of the first step that has any."""
    held = held or {}
    worst: dict[str, float] = {}
    for s, (full, want) in enumerate(zip(steps, ref["grads"])):
        out = []
        # a tensor no rank has a gradient for: zero, as an optimizer steps it; wrong unless the reference's is
        got = {n: full.get(n, np.zeros_like(w)) for n, w in want.items()}
        for n in want:
            if n not in full and np.any(want[n]):
                out.append(Finding("gradients", n, f"no rank has a gradient for it at step {s}", s))
        for n, (e, scale) in tensor_errors(got, want).items():
            ratio = e / scale if scale else (0.0 if e == 0 else np.inf)
            worst[n] = max(worst.get(n, 0.0), ratio, key=lambda x: np.nan_to_num(x, nan=np.inf))
            bound = within.grad(n)
            if not ratio <= bound and n in full:  # NaN is over every bound
                msg = f"step {s}'s gradient is {ratio:.3g} (relative, floored) from the reference's > {bound:.3g}"
                out.append(Finding("gradients", n, msg, s, held.get(n, ()), ratio, bound))
        if out:  # the first step a gradient goes wrong is where to look; later ones follow from it
            out.sort(key=lambda f: -np.nan_to_num(f.error, nan=np.inf))  # the worst first
            return worst, out
    return worst, []


def uniform_factor(full: dict, ref: dict, bound: float) -> float | None:
    """c where every tensor's first-step gradient is c·g_ref (|c - 1| beyond the bound), else None: each
    tensor within FACTOR_TOL of the line, or within the bound where the bound is wider (bf16's roundings
    move every tensor off the line by up to the bound)."""
    tol = max(FACTOR_TOL, bound)
    factors = []
    for n, r in ref["grads"][0].items():
        r = r.astype(np.float64).reshape(-1)
        rr = float(r @ r)
        if rr == 0:
            continue
        if n not in full:
            return None
        g = full[n].astype(np.float64).reshape(-1)
        c = float(g @ r) / rr  # the least-squares factor of this tensor
        if not np.isfinite(c) or np.linalg.norm(g - c * r) > tol * max(abs(c), 1e-30) * rr**0.5:
            return None
        factors.append(c)
    if not factors:
        return None
    c = float(np.median(factors))
    if any(abs(f - c) > 2 * tol * abs(c) for f in factors) or abs(c - 1) <= tol:
        return None
    return c


def losses(reports: list[dict], ref: dict, bound: float, dp_size: int) -> tuple[list[dict], list[Finding]]:
    """Each step's loss: the ranks of one data slice agree; the mean over slices is the reference's."""
    rows, out = [], []
    for s, want in enumerate(ref["losses"]):
        slices: dict[int, list[tuple[int, float]]] = {}
        for r in reports:
            if r["losses"][s] is not None:
                slices.setdefault(r["dp_rank"], []).append((r["rank"], r["losses"][s]))
        missing = sorted(set(range(dp_size)) - set(slices))
        if missing:
            out.append(Finding("losses", "loss", f"no rank of data slice(s) {missing} returned a loss", s))
            rows.append({"step": s, "reference": want, "run": float("nan"), "error": float("nan"), "bound": bound})
            continue
        for d, got in sorted(slices.items()):
            (r0, v0), *rest = got
            for rk, v in rest:
                if not loss_errors([v], [v0])[0] <= bound:
                    msg = f"rank {rk}'s loss {v:.6g} differs from rank {r0}'s {v0:.6g} (data slice {d})"
                    out.append(Finding("loss replicas", "loss", msg, s, (r0, rk)))
        run = float(np.mean([got[0][1] for _, got in sorted(slices.items())]))
        err = loss_errors([run], [want])[0]
        rows.append({"step": s, "reference": want, "run": run, "error": err, "bound": bound})
        if not err <= bound:
            msg = f"{run:.6g} against the reference's {want:.6g} (relative {err:.3g} > {bound:.3g})"
            out.append(Finding("losses", "loss", msg, s, error=err, bound=bound))
    return rows, out


def parameters(full: dict, ref: dict, bound: float) -> tuple[dict, list[Finding]]:
    """The final parameters, whole model (checks.model_error); per tensor for diagnosis."""
    want = {n: w for n, w in ref["final"].items() if n in full}
    if not want:
        return {}, []
    errs = {n: _rel(full[n], w) for n, w in want.items()}
    err = model_error(full, want)
    if err <= bound:
        return errs, []
    worst = sorted(errs, key=lambda n: -np.nan_to_num(errs[n], nan=np.inf))[:3]
    msg = (
        f"the final parameters differ from the reference by {err:.3g} (relative L2, whole model) > {bound:g}; "
        "worst: " + ", ".join(f"{n} {errs[n]:.3g}" for n in worst)
    )
    return errs, [Finding("parameters", worst[0], msg, error=err, bound=bound)]


def judge(ref: dict, reports: list[dict], within: Bounds, dp_size: int) -> dict:
    """Every check of the ranks' reports against the reference (replayed along them: verify.py): findings
    in CHECKS order, a row per tensor, a row per step's loss, and the uniform factor (or None)."""
    found = coverage(ref, reports) + plan(reports)
    start, dtypes, f0 = gathered(reports, "initial", "parameters")
    grads, f1 = [], []
    for s in range(len(ref["grads"])):
        full, _, more = gathered(reports, "grads", "gradients", s)
        grads.append(full)
        f1 += more
    final, _, f2 = gathered(reports, "final", "parameters")
    init_err, f3 = initial(start, dtypes, ref, len(reports))
    grad_err, f4 = gradients(grads, ref, within, holders(reports, "grads"))
    loss_rows, f5 = losses(reports, ref, within.losses, dp_size)
    final_err, f6 = parameters(final, ref, within.params)
    found += f0 + f1 + f2 + f3 + f4 + f5 + f6
    found.sort(key=lambda f: CHECKS.index(f.check))  # stable: within a check, the order found
    bad = {}
    for f in found:
        bad.setdefault(f.tensor, f.check)
    rows = [
        {
            "tensor": n,
            "shape": tuple(w.shape),
            "initial error": init_err.get(n, float("nan")),
            "gradient error": grad_err.get(n, float("nan")),
            "gradient bound": within.grad(n),
            "final error": final_err.get(n, float("nan")),
            "status": bad.get(n, "ok"),
        }
        for n, w in ref["initial"].items()
    ]
    factor = uniform_factor(grads[0], ref, max(within.grad(n) for n in ref["initial"])) if grads else None
    return {"findings": found, "rows": rows, "losses": loss_rows, "factor": factor}
