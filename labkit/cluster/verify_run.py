"""Lab.verify on the Lab's engines: the user's build() and parallelize run as a job on every rank
(engines/verify.py), and what the ranks send is judged against build() alone in this process, replayed
along the run (labkit/oracle/verify.py says what is compared, and how; verify_checks.py the checks).
"""

from __future__ import annotations

from math import prod

from labkit.cluster.arguments import timeout_problems
from labkit.cluster.shipping import by_value
from labkit.config import ConfigError
from labkit.config.choices import numerics
from labkit.engines import runtime
from labkit.engines.verify import default_optimizer
from labkit.oracle import verify_checks
from labkit.oracle.verify import DATA_DIMS, block_count, problems, reference_build, reference_steps, verify_bounds
from labkit.oracle.verify_report import VerifyReport


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
    built = reference_build(fns, seed)
    spec = dict(mesh=dict(mesh), data_dims=data_dims, steps=steps, seed=seed, fingerprints=built["prints"])
    spec["count_roundings"] = numerics(precision).mixed  # bf16's bounds: the roundings the ranks' step makes
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
    within = verify_bounds(
        precision, reports, set(built["names"].values()), mesh, data_dims, block_count(built["model"])
    )
    run_grads = verify_checks.step_gradients(reports, steps)
    ref = reference_steps(built, fns, steps, run_grads)
    dp_size = prod(mesh[d] for d in data_dims)
    return VerifyReport(verify_checks.judge(ref, reports, within, dp_size), dict(mesh), steps, precision, within)
