"""verify cannot be fooled by a weaker verify: each mutation of its checks (a check skipped, the
replica comparison loosened, a bound widened, the factor never found) lets some bug of
tests/test_verify.py through, i.e. makes that test's expectation fail.

The bugs run once on the session's cluster, as test_verify.py runs them, with what the ranks sent
recorded; each mutation then judges those same reports again (labkit/oracle/verify_checks.py
with one function replaced), so a mutation costs no engine time. The unmutated judgement of the
same reports must satisfy every expectation first (the control).
"""

from __future__ import annotations

import pytest
from verify_cases import BUGS, batch, build, loss, options_in

from labkit.oracle import verify_checks as vc
from labkit.oracle.assembly import assemble
from labkit.oracle.bounds import tensor_errors
from labkit.oracle.verify_report import VerifyReport


def _no_differs(pieces, what):
    full, issues = assemble(pieces, what)
    return full, [i for i in issues if i.kind != "differs"]


def _bound_times_1e6(grads, ref):
    return {n: (e * 1e-6, scale) for n, (e, scale) in tensor_errors(grads, ref).items()}


MUTATIONS = {
    # name: (the attribute of verify_checks replaced, its replacement, a bug it must let through)
    "initial check skipped": ("initial", lambda full, dtypes, ref, world: ({}, []), "one seed per shard"),
    "replicas not compared": ("assemble", _no_differs, "norm outside SP"),
    "replicas not compared (params)": ("assemble", _no_differs, "replicas step apart"),
    "gradients check skipped": ("gradients", lambda full, ref, bound, held=None: ({}, []), "same batch on every rank"),
    "gradient bound widened": ("tensor_errors", _bound_times_1e6, "same batch on every rank"),
    "parameters check skipped": ("parameters", lambda full, ref, bound: ({}, []), "another lr on the ranks"),
    "losses check skipped": ("losses", lambda reports, ref, bound, dp: ([], []), "loss reported summed"),
    "plan check skipped": ("plan", lambda reports: [], "plan key matches nothing"),
    "coverage check skipped": ("coverage", lambda ref, reports: [], "a parameter on no rank"),
    "factor never found": ("uniform_factor", lambda full, ref, bound: None, "summed, not averaged"),
}


PRECISIONS = ("fp32", "bf16")
"""Each bug recorded in both (bf16: its step under autocast, held to bf16's bounds; verify runs no fp8)."""


@pytest.fixture(scope="module")
def recorded(lab):
    """Each bug's judge() arguments in each precision, recorded while lab.verify runs it."""
    out = {}
    real = vc.judge
    for bug in {m[2] for m in MUTATIONS.values()}:
        parallelize, mesh, options, _ = BUGS[bug]
        for precision in PRECISIONS:
            seen = []
            vc.judge = lambda *args, seen=seen: seen.append(args) or real(*args)
            try:
                lab.verify(build, parallelize, mesh, batch, loss, **options_in(precision, options))
            finally:
                vc.judge = real
            out[bug, precision] = (seen[0], mesh)
    return out


def judged(args, mesh, precision) -> VerifyReport:
    return VerifyReport(vc.judge(*args), mesh, 2, precision, args[2])


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_weaker_verify_lets_a_bug_through(recorded, monkeypatch, name, precision):
    attr, replacement, bug = MUTATIONS[name]
    args, mesh = recorded[bug, precision]
    expect = BUGS[bug][3]
    control = judged(args, mesh, precision)
    expect(control)  # the control: the real checks catch it
    f = control.first()
    # the margin it is caught by: the first finding's error over its bound (exact checks have none)
    over = f.error / f.bound if f is not None and f.bound and f.bound == f.bound else float("nan")
    print(f"\n{bug} ({precision}): caught by [{f.check if f else '-'}] {f.tensor if f else ''}, error/bound {over:.3g}")
    monkeypatch.setattr(vc, attr, replacement)
    with pytest.raises(AssertionError):
        expect(judged(args, mesh, precision))
