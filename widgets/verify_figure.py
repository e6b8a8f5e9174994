"""Lab.verify's report drawn (labkit/oracle/verify_report.py): where in the model a plan is wrong, how
far past its bound, and on which ranks. Pure: a VerifyReport in, a go.Figure out.

Every check is drawn as its error over its bound, on a log scale, so the bound is 1 for all of them:
a tensor's gradient at its worst step (relative, floored: labkit/oracle/bounds.py), its final weights
(relative L2, against the whole model's bound, which the check applies to the sum), each step's loss.
The initial weights and every replica must be exact: an exact one is drawn at the axis's floor ('0'),
one that differs at its ceiling ('≠ / NaN'), where no finite ratio would say more.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.widgets.style import CATEGORY_COLORS, GRID, Palette, _layout

CHECK_COLORS = {
    "initial": "#9D755D",
    "gradients": CATEGORY_COLORS["grads"],
    "parameters": CATEGORY_COLORS["params"],
    "losses": CATEGORY_COLORS["optimizer"],
    "replicas": "#B279A2",
}
STRIPS = ("finite", "initial replicas", "gradient replicas", "loss replicas", "parameter replicas")
"""The checks of every copy bit for bit (and of finite values), drawn per rank: verify_checks.CHECKS's."""
BAD = "#D62728"


def _where(report) -> str:
    return ", ".join(f"{k}={v}" for k, v in report.mesh.items())


def _failing(report) -> set[tuple[str, str]]:
    return {(f.check, f.tensor) for f in report.findings}


def error_ratios(report) -> dict[str, dict[str, float]]:
    """check -> {tensor, or 'loss, step s': error over its bound}, as drawn: 0 where an exact check
    holds, inf where it fails; NaN where a tensor was not checked (no rank holds it: a coverage finding)."""
    bad = _failing(report)
    out: dict[str, dict[str, float]] = {"initial": {}, "gradients": {}, "parameters": {}, "losses": {}}
    for row in report.rows:
        t, e = row["tensor"], row["initial error"]
        # exact or not: any difference right after parallelize is a bug, however small
        out["initial"][t] = math.nan if math.isnan(e) else (0.0 if e == 0 else math.inf)
        # a NaN gradient error that a finding names is a failure (NaN is over every bound), not a gap
        g = row["gradient error"] / row["gradient bound"]
        out["gradients"][t] = math.inf if math.isnan(g) and ("gradients", t) in bad else g
        out["parameters"][t] = row["final error"] / report.bounds.params
    for row in report.losses:
        e = row["error"] / row["bound"]
        out["losses"][f"loss, step {row['step']}"] = math.inf if math.isnan(e) else e
    return out


def replica_strips(report) -> dict[str, list[int]]:
    """check -> per rank, how many tensors (or losses) of that rank differ from another rank's copy or
    are not finite. The rank counted is the one whose copy differs (a finding's last rank: the first is
    the copy it was compared with)."""
    world = int(np.prod(list(report.mesh.values()))) if report.mesh else 1
    out = {c: [0] * world for c in STRIPS}
    for f in report.findings:
        if f.check in out and f.ranks and f.ranks[-1] < world:
            out[f.check][f.ranks[-1]] += 1
    return out


def _scale(values) -> tuple[float, float]:
    """(floor, ceiling) of the log axis: a decade below the smallest ratio drawn and above the largest
    (the bound, 1, always inside); exact ones are drawn at the floor, failed exact ones at the ceiling."""
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    lo = min(finite + [1.0])
    hi = max(finite + [1.0])
    return 10.0 ** (math.floor(math.log10(lo)) - 1), 10.0 ** (math.ceil(math.log10(hi)) + 1)


def _placed(v: float, floor: float, ceiling: float) -> float | None:
    if math.isnan(v):
        return None  # not checked: no point
    if v == 0:
        return floor
    return ceiling if math.isinf(v) else v


def _log_ticks(axis, floor: float, ceiling: float) -> None:
    lo, hi = round(math.log10(floor)), round(math.log10(ceiling))
    step = max(1, (hi - lo) // 8)  # at most ~9 labelled decades
    inner = [10.0**k for k in range(lo + 1, hi) if (k - lo) % step == 0 or k == 0]
    vals = [floor, *inner, ceiling]
    text = ["0 (exact)", *[("1 (bound)" if v == 1 else f"{v:g}") for v in inner], "≠ / NaN"]
    axis(type="log", tickvals=vals, ticktext=text, range=[lo - 0.4, hi + 0.4], gridcolor=GRID)


def _first_note(report) -> str:
    f = report.first()
    if f is None:
        return ""
    return f"first failure: [{f.check}] {f.tensor}"


def verify_figure(report) -> go.Figure:
    """Every tensor's error over its bound at each check (log scale, the bound at 1), the losses
    below them, and under it one strip per replica check with a cell per rank; the first failure
    (report.first()) marked and named."""
    ratios = error_ratios(report)
    strips = replica_strips(report)
    labels = [row["tensor"] for row in report.rows] + list(ratios["losses"])
    floor, ceiling = _scale([v for by in ratios.values() for v in by.values()])
    world = len(next(iter(strips.values())))
    # heights in pixels: a row per tensor and per strip, whatever the model's size
    main, strip, gap, top, bottom = 26 * len(labels) + 20, 26 * len(STRIPS), 80, 110, 60
    plot = main + gap + strip
    fig = make_subplots(rows=2, cols=1, row_heights=[main, strip], vertical_spacing=gap / plot)
    colors = Palette()
    for check, by in ratios.items():
        names = [n for n in labels if n in by and _placed(by[n], floor, ceiling) is not None]
        fig.add_scatter(
            name=check,
            x=[_placed(by[n], floor, ceiling) for n in names],
            y=names,
            # the true ratio rides along: a point drawn at the floor or the ceiling stands for 0 or ∞
            customdata=[by[n] for n in names],
            mode="markers",
            marker=dict(size=9, color=colors(check, CHECK_COLORS[check]), line=dict(width=1, color="white")),
            hovertemplate=f"{check}: %{{customdata:.3g}} × its bound<extra>%{{y}}</extra>",
            row=1,
            col=1,
        )
    # the bound, and the side of it that fails
    fig.add_vline(x=1, line=dict(dash="dash", color=BAD), row=1, col=1)
    fig.add_vrect(x0=1, x1=ceiling * 3, fillcolor=BAD, opacity=0.06, line_width=0, row=1, col=1)
    z = [strips[c] for c in STRIPS]
    hover = [
        [f"{c}: rank {r}'s copy differs, or is not finite, in {n} tensor(s)" for r, n in enumerate(s)]
        for c, s in zip(STRIPS, z)
    ]
    fig.add_heatmap(
        z=z,
        x=[f"r{r}" for r in range(world)],
        y=list(STRIPS),
        zmin=0,
        zmax=max(1, max(max(s) for s in z)),
        colorscale=[[0, "#F2F5FA"], [1, BAD]],
        showscale=False,
        texttemplate="%{z}",
        hovertext=hover,
        hovertemplate="%{hovertext}<extra></extra>",
        xgap=2,
        ygap=2,
        name="replicas per rank",
        row=2,
        col=1,
    )
    f = report.first()
    if f is not None:
        note = dict(text=_first_note(report), showarrow=True, arrowhead=2, arrowcolor=BAD, font=dict(color=BAD))
        note["bgcolor"] = "rgba(255, 255, 255, 0.85)"  # legible over a red cell or a point
        if f.check in STRIPS and f.ranks:
            fig.add_annotation(x=f"r{f.ranks[-1]}", y=f.check, ax=40, ay=-30, row=2, col=1, **note)
        else:
            key = {"initial": "initial", "gradients": "gradients", "parameters": "parameters", "losses": "losses"}
            by = ratios.get(key.get(f.check, ""), {})
            name = f"loss, step {f.step}" if f.check == "losses" else f.tensor
            if name in by and _placed(by[name], floor, ceiling) is not None:
                fig.add_annotation(
                    x=math.log10(_placed(by[name], floor, ceiling)), y=name, ax=-60, ay=-25, row=1, col=1, **note
                )
    _log_ticks(lambda **kw: fig.update_xaxes(row=1, col=1, title="error over its bound", **kw), floor, ceiling)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title="rank", side="bottom", row=2, col=1)
    fig.update_yaxes(automargin=True)
    # two lines: the verdict, then what to look at (a tensor's name would push one line past the cell)
    if report.ok:
        why = "every tensor, loss and copy within its bound: left of the dashed line at 1"
    elif report.factor is not None:
        why = f"{_first_note(report)}; every first-step gradient is {report.factor:.4g} × the reference's"
    else:
        why = _first_note(report) + (" (the rank marked below)" if f is not None and f.check in STRIPS else "")
    title = f"verify {'OK' if report.ok else 'FAILED'} on {_where(report)}<br><sup>{why}</sup>"
    return _layout(
        fig,
        title,
        height=top + plot + bottom,
        margin=dict(l=60, r=20, t=top, b=bottom),
        legend=dict(orientation="h", yanchor="bottom", y=1.01, x=0, xanchor="left"),
    )


def worst_ratios(report) -> dict[str, float]:
    """Per check, the worst error over its bound of any tensor (or loss); 'replicas': 0 when every copy
    and every value is the same and finite, inf when any is not (exact checks)."""
    ratios = error_ratios(report)
    out = {}
    for check, by in ratios.items():
        vals = [v for v in by.values() if not math.isnan(v)]
        out[check] = max(vals, default=math.nan)
    out["replicas"] = math.inf if any(f.check in STRIPS for f in report.findings) else 0.0
    return out


def verifies_figure(reports: dict) -> go.Figure:
    """Several reports side by side (name -> VerifyReport): each check's worst error over its bound,
    log scale, the bound at 1 — which checks each plan fails, and by how much."""
    worst = {name: worst_ratios(r) for name, r in reports.items()}
    checks = list(CHECK_COLORS)
    floor, ceiling = _scale([v for w in worst.values() for v in w.values() if not math.isnan(v)])
    fig = make_subplots(rows=1, cols=1)
    colors = Palette()
    names = list(reports)
    for check in checks:
        shown = [n for n in names if _placed(worst[n][check], floor, ceiling) is not None]
        fig.add_scatter(
            name=check,
            x=shown,
            y=[_placed(worst[n][check], floor, ceiling) for n in shown],
            customdata=[worst[n][check] for n in shown],
            mode="markers",
            marker=dict(size=11, color=colors(check, CHECK_COLORS[check]), line=dict(width=1, color="white")),
            hovertemplate=f"{check}: worst %{{customdata:.3g}} × its bound<extra>%{{x}}</extra>",
        )
    fig.add_hline(y=1, line=dict(dash="dash", color=BAD))
    fig.add_hrect(y0=1, y1=ceiling * 3, fillcolor=BAD, opacity=0.06, line_width=0)
    _log_ticks(lambda **kw: fig.update_yaxes(title="worst error over its bound", **kw), floor, ceiling)
    failed = [n for n, r in reports.items() if not r.ok]
    title = (
        f"{len(failed)} of {len(reports)} plans fail<br><sup>the checks above the dashed line at 1: "
        + ", ".join(failed)
        + "</sup>"
        if failed
        else f"All {len(reports)} plans pass<br><sup>each one's every check under its bound: below the line at 1</sup>"
    )
    return _layout(fig, title, height=400, margin=dict(l=60, r=20, t=90, b=50))
