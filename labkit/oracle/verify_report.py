"""What Lab.verify returns: whether the user's parallel code trains like build() alone, and if not,
the earliest check that fails and the tensor it fails on (labkit/oracle/verify_checks.py)."""

from __future__ import annotations

from labkit.config.table import Rows, card
from labkit.oracle.bounds import Bounds


def factor_reason(c: float) -> str:
    """What a uniform gradient factor usually means (the issue's bugs, by their factor)."""
    n = round(c) if c >= 1 else round(1 / c)
    exact = abs((c if c >= 1 else 1 / c) - n) <= 1e-3 * n
    if exact and c > 1:
        return (
            f"summed where it should be averaged (over {n} ranks), or a loss not divided by its {n} accumulation steps"
        )
    if exact:
        return f"divided by {n} once too often (an average taken twice, or a loss scaled by 1/{n} twice)"
    return "one scale applied to every gradient: a loss scaled by a constant"


class VerifyReport:
    """The verdict of Lab.verify.

    ok / assert_ok(): everything held. summary(): one line, leading with the earliest check that
    fails (`findings[0]`, in verify_checks.CHECKS order) and its tensor, or the uniform factor.
    df: one row per tensor of build() (initial / gradient / final errors, the first failing check
    as status); losses: one row per step. findings: every problem found, in check order."""

    def __init__(self, judged: dict, mesh: dict, steps: int, precision: str, within: Bounds):
        self.findings = judged["findings"]
        self.factor: float | None = judged["factor"]
        """c when every first-step gradient is c times the reference's (a uniform error), else None."""
        self.rows = Rows(judged["rows"])
        self.losses = Rows(judged["losses"])
        self.mesh, self.steps, self.precision, self.bounds = mesh, steps, precision, within

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def df(self):
        """One row per tensor, as a pandas DataFrame."""
        return self.rows.df

    def first(self):
        """The earliest finding (the check that a bug shows in first), or None."""
        return self.findings[0] if self.findings else None

    def summary(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        if self.ok:
            return (
                f"verify OK on {where}: {len(self.rows)} tensors, {self.steps} step(s), {self.precision} "
                f"(initial weights exact; gradients within {self.bounds.grad_norms:g}, losses {self.bounds.losses:g}, "
                f"final weights {self.bounds.params:g})"
            )
        f = self.findings[0]
        if self.factor is not None and f.check in ("gradients", "losses", "parameters"):
            # the bug is one scale, not one tensor: say the scale
            return (
                f"verify FAILED on {where}: [gradients] every tensor's first-step gradient is "
                f"{self.factor:.4g} x the reference's: {factor_reason(self.factor)}"
            )
        at = ", ".join(
            ([f"step {f.step}"] if f.step is not None else [])
            + ([f"ranks {list(f.ranks)}"] if f.ranks and f.check in ("gradients", "initial", "parameters") else [])
        )
        at = f" ({at})" if at else ""
        return f"verify FAILED on {where}: {f}{at}"

    def assert_ok(self) -> None:
        """Raise AssertionError with the summary and every finding, unless everything held."""
        if not self.ok:
            lines = "\n".join(f"  {f}" for f in self.findings[:20])
            more = f"\n  ... and {len(self.findings) - 20} more" if len(self.findings) > 20 else ""
            raise AssertionError(f"{self.summary()}\n{lines}{more}")

    def figure(self):
        """This report drawn (labkit.widgets.verify_figure): every tensor's error over its bound at
        each check on a log scale, the bound at 1, the first failure marked and named, a strip per
        replica check with a cell per rank."""
        # deferred, and the ladder's one upward import (tests/test_layers.py UPWARD): plotly loads only
        # when a report is drawn, and the figure's style lives with every other figure's, in widgets/
        from labkit.widgets.verify_figure import verify_figure

        return verify_figure(self)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        facts = [("verdict", self.summary())]
        facts += [(f.check, f"{f.tensor}: {f.message}") for f in self.findings[:8]]
        bad = Rows(r for r in self.rows if r["status"] != "ok")
        tables = [("tensors that fail", bad), ("losses", self.losses), ("every tensor", self.rows)]
        return card("verify: " + ("OK" if self.ok else "FAILED"), facts, tables)
