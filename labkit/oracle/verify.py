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
for bit; every step's gradient of each tensor and each step's loss within bounds.py's bounds,
against the reference replayed along the run (each step's update applies the run's own gradients:
labkit/oracle/replay.py says why); the final parameters, whole model. The Lab's side of it (the
ranks' job, the reports) is labkit/cluster/verify_run.py.
"""

from __future__ import annotations

from math import prod

from labkit.config import ConfigError
from labkit.config.choices import PRECISIONS, numerics
from labkit.engines.verify import as_loss, canonical_names, fingerprints, read_tensors
from labkit.oracle.bounds import Bounds, bounds

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


def reference_build(fns: dict, seed: int) -> dict:
    """build() alone in this process, twice under one seed (it must be deterministic): the model, its
    weights by name, and their fingerprints (what every rank's build() must give too)."""
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
    with torch.no_grad():  # a loss that is not a scalar is refused here, before any rank starts
        _scalar(fns["loss"](model, fns["batch"](0)), 0)
    return {"model": model, "names": names, "initial": initial, "prints": prints}


def _scalar(value, step: int) -> None:
    import torch

    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(
            [f"loss(model, batch) gave {shape} at step {step}; it must be a scalar tensor (e.g. .mean())"]
        )


def reference_steps(built: dict, fns: dict, steps: int, run_grads: list[dict]) -> dict:
    """`steps` plain steps of build()'s model on each whole global batch, replayed along the run
    (labkit/oracle/replay.py): each step's loss and gradients are this process's own, the update applies
    the run's gradients of that step (`run_grads`, full tensors by name; a tensor no rank has a gradient
    for is zero, as an optimizer steps it). Returns the losses, every step's gradients, the final weights."""
    import torch

    model, names, initial = built["model"], built["names"], built["initial"]
    params = dict(model.named_parameters())
    by_canon = {canon: params[name] for name, canon in names.items() if name in params}
    opt = fns["optimizer"](list(model.parameters()))
    losses, grads = [], []
    for s in range(steps):
        value = fns["loss"](model, fns["batch"](s))
        _scalar(value, s)
        value.backward()
        got = {p["name"]: p["values"] for p in read_tensors(model, names, -1, grads=True)[0]}
        # a parameter backward never reached has no gradient: zero, as an optimizer treats it
        grads.append({n: got.get(n, 0 * v) for n, v in initial.items()})
        for n, p in by_canon.items():  # the run's gradient is what this step's update applies
            run = run_grads[s].get(n) if s < len(run_grads) else None
            p.grad = torch.zeros_like(p) if run is None else torch.from_numpy(run.copy()).to(p.dtype).reshape(p.shape)
        opt.step()
        opt.zero_grad()
        losses.append(as_loss(value, s))
    final = {p["name"]: p["values"] for p in read_tensors(model, names, -1)[0]}
    return {**built, "grads": grads, "losses": losses, "final": final}


def block_count(model) -> int:
    """The blocks of `build()`'s model: its longest nn.ModuleList (the layers a TP plan splits)."""
    import torch

    return max((len(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)), default=1)


def verify_bounds(precision: str, reports: list[dict], names, mesh: dict, data_dims: tuple, layers: int) -> Bounds:
    """The bounds the user's run is held to: fp32's; bf16's with each tensor's roundings counted on the
    ranks' own step (engines/verify.py: every op of the parallelized graph whose result is bf16 and not a
    copy, engines/meters/rounding.py), the most of any rank, plus what the mesh adds (bounds.layout_roundings
    with every dim that does not split the batch taken as tensor-parallel, which adds the most). A tensor
    no rank counted (its gradient made where the count could not see, or on no rank) gets the deepest.
    `names`: build()'s parameters."""
    if not numerics(precision).mixed:
        return bounds(precision)
    counted: dict[str, int] = {}
    for r in reports:
        for n, d in r.get("roundings", {}).items():
            counted[n] = max(counted.get(n, 0), d)
    deepest = max(counted.values(), default=0)
    split = prod(mesh[d] for d in mesh if d not in data_dims)
    extra = 1 + 4 * layers * (split - 1)  # the data reduction's rounding; the other dims' partial sums
    return bounds(precision, {n: counted.get(n, deepest) + extra for n in names})
