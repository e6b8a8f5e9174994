"""Is the user's parallel code right? `Lab.verify`: their `build()` alone in this process is the
reference; their `parallelize` on the Lab's engines is judged against it, tensor by tensor.

    report = lab.verify(build, parallelize, mesh={"dp": 2, "tp": 2}, batch=batch, loss=loss, steps=2)
    report.assert_ok()

What the reference is: `build()` (after `torch.manual_seed(seed)`), one plain step per step —
`loss(model, batch(step))` on the whole global batch, backward, `optimizer.step()` — in this process,
with no parallel code at all. What the ranks do (engines/verify.py): the same `build()` under the
same seed, `parallelize(model, mesh)` on a DeviceMesh of the named sizes, then per step the rank
step (by default: this rank's slice of the global batch along dim 0, by its data-parallel
coordinate over the data dims, the loss, backward) and the same optimizer. Where the data
parallelism is the user's own (their sampler, their microbatches, a pipelining schedule), they
pass `step(model, batch, ctx)`: it gets the global batch and does forward and backward, returning
the mean loss of this rank's share (None on ranks that compute none, e.g. early pipeline stages).

The checks (labkit/oracle/verify_checks.py) and the report (labkit/oracle/verify_report.py) follow
labkit's own oracle (checks.py): the parameters right after parallelize, exactly; every copy bit
for bit; the first step's gradient of each tensor and each step's loss within bounds.py's
bounds; the final parameters, whole model.
"""

from __future__ import annotations

from math import prod

from labkit.cluster.arguments import timeout_problems
from labkit.cluster.shipping import by_value
from labkit.config import ConfigError
from labkit.config.choices import PRECISIONS, numerics
from labkit.engines import runtime
from labkit.engines.verify import as_loss, canonical_names, default_optimizer, fingerprints, read_tensors
from labkit.oracle.bounds import bounds
from labkit.oracle.verify_checks import judge
from labkit.oracle.verify_report import VerifyReport

DATA_DIMS = ("dp", "dp_replicate", "dp_shard", "fsdp", "ddp", "hsdp")
"""Mesh dims that split the batch when `data_dims` is not given (torchtitan's names and labkit's)."""


def problems(world, build, parallelize, mesh, batch, loss, optimizer, steps, step, precision, data_dims, seed):
    """Every problem with verify's arguments, each with a fix (before anything runs)."""
    bad = []
    for name, fn in (("build", build), ("parallelize", parallelize), ("batch", batch), ("loss", loss)):
        if not callable(fn):
            bad.append(f"{name}={fn!r} is not callable; pass a function (the docstring of Lab.verify says its shape)")
    for name, fn in (("optimizer", optimizer), ("step", step)):
        if fn is not None and not callable(fn):
            bad.append(f"{name}={fn!r} is not callable; pass a function or None for labkit's default")
    if not isinstance(mesh, dict) or not mesh:
        bad.append(f"mesh={mesh!r} must name each dim's size, e.g. {{'dp': {world}}}")
    elif not all(isinstance(k, str) and type(v) is int and v > 0 for k, v in mesh.items()):
        bad.append(f"mesh={mesh!r}: names must be strings and sizes positive whole numbers, e.g. {{'dp': 2, 'tp': 2}}")
    elif prod(mesh.values()) != world:
        sizes = " * ".join(f"{k}({v})" for k, v in mesh.items())
        bad.append(
            f"mesh={mesh!r}: {sizes} = {prod(mesh.values())} ranks, but this Lab has {world} engines; "
            f"make the sizes multiply to {world} (e.g. {{'dp': {world}}}) or start Lab(engines={prod(mesh.values())})"
        )
    else:
        for d in data_dims or ():
            if d not in mesh:
                bad.append(f"data_dims: {d!r} is not a dim of mesh={mesh!r}; name dims of the mesh, or () for none")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        bad.append(f"steps={steps!r} must be a whole number >= 1; try 2")
    if not isinstance(seed, int) or isinstance(seed, bool):
        bad.append(f"seed={seed!r} must be a whole number; try 0")
    if precision not in PRECISIONS or numerics(precision).fp8:
        bad.append(f"precision={precision!r}: the bounds exist for 'fp32' and 'bf16' (labkit/oracle/bounds.py)")
    return bad


def reference_steps(fns: dict, steps: int, seed: int) -> dict:
    """build() alone in this process, `steps` plain steps on each whole global batch: the weights
    it starts from, the first step's gradients, the losses and the final weights, by name."""
    import torch

    torch.manual_seed(seed)
    model = fns["build"]()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([f"build() returned {type(model).__name__}; it must return an nn.Module"])
    torch.manual_seed(seed)
    again = fingerprints(fns["build"]())
    prints = fingerprints(model)
    # two builds under one seed must agree, or no rank's weights can be held to the reference's
    differ = sorted(n for n in prints if again.get(n) != prints[n])
    if differ:
        raise ConfigError(
            [
                f"build() is not deterministic: two calls under torch.manual_seed({seed}) gave different "
                f"weights for {differ[:3]}{' ...' if len(differ) > 3 else ''}; draw every weight from torch's "
                "global generator (no time, rank or os.urandom seeds)"
            ]
        )
    names = canonical_names(model)
    initial = {p["name"]: p["values"] for p in read_tensors(model, names, -1)[0]}
    opt = fns["optimizer"](list(model.parameters()))
    losses, grads = [], {}
    for s in range(steps):
        value = fns["loss"](model, fns["batch"](s))
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                [f"loss(model, batch) gave {shape} at step {s}; it must be a scalar tensor (e.g. .mean())"]
            )
        value.backward()
        if s == 0:
            got = {p["name"]: p["values"] for p in read_tensors(model, names, -1, grads=True)[0]}
            # a parameter backward never reached has no gradient: zero, as an optimizer treats it
            grads = {n: got.get(n, 0 * v) for n, v in initial.items()}
        opt.step()
        opt.zero_grad()
        losses.append(as_loss(value, s))
    final = {p["name"]: p["values"] for p in read_tensors(model, names, -1)[0]}
    # depth for bf16's bounds ((2L + 4)·u): the longest ModuleList, the usual stack of blocks
    depth = max((len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), default=1)
    return {"initial": initial, "grads": grads, "losses": losses, "final": final, "prints": prints, "depth": depth}


def verify(
    lab,
    build,
    parallelize,
    mesh: dict,
    batch,
    loss,
    optimizer=None,
    steps: int = 2,
    step=None,
    precision: str = "fp32",
    data_dims=None,
    seed: int = 0,
    timeout: float | None = None,
) -> VerifyReport:
    """Lab.verify's body (its docstring says what each argument is)."""
    bad = problems(lab.world, build, parallelize, mesh, batch, loss, optimizer, steps, step, precision, data_dims, seed)
    bad += timeout_problems(timeout)
    if bad:
        raise ConfigError(bad)
    data_dims = tuple(d for d in mesh if d in DATA_DIMS) if data_dims is None else tuple(data_dims)
    fns = dict(build=build, parallelize=parallelize, batch=batch, loss=loss, step=step)
    fns["optimizer"] = optimizer or default_optimizer  # engines/verify.py's: it travels by name
    ref = reference_steps(fns, steps, seed)
    spec = dict(mesh=dict(mesh), data_dims=data_dims, steps=steps, seed=seed, fingerprints=ref["prints"])
    # named, not imported: engines/verify.py runs on the ranks; the Lab's job machinery bounds it
    target = ("labkit.engines.verify:verify_rank", by_value(fns), spec)
    reports = lab._execute(runtime.call_named, target, {}, timeout, lab.progress, steps, "verify")
    differ = sorted({n for r in reports for n in r.get("build_differs", [])})
    if differ:
        ranks = [r["rank"] for r in reports if r.get("build_differs")]
        raise ConfigError(
            [
                f"build() gave rank(s) {ranks} other weights than this process under the same seed, for "
                f"{differ[:3]}{' ...' if len(differ) > 3 else ''}: it must not depend on the rank, the host or the time"
            ]
        )
    dp_size = prod(mesh[d] for d in data_dims)
    within = bounds(precision, ref["depth"])
    return VerifyReport(judge(ref, reports, within, dp_size), dict(mesh), steps, precision, within)
