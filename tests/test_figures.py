"""Every figure builder draws something a person can read (no cluster: results built from the
simulator and the theory): no two series of a figure share a colour, no legend entry appears
twice, and no hover or label text says `None`."""

from __future__ import annotations

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.layout.mesh import MeshLayout
from labkit.results.measurement import Measurement
from labkit.results.run import CommEvent, Event, RankReport, RunResult
from labkit.theory.exact import pipeline as tp
from labkit.widgets import figures, theory_figures
from labkit.widgets.at_scale import at_scale
from labkit.widgets.plans import gpu_memory_figure
from labkit.widgets.style import Palette, shade

MODEL = ModelConfig(layers=4, hidden=32, heads=4, ffn=128, vocab=128, seq=16)
MOE = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=128, seq=16, experts=4, top_k=2)
OPS = [("all_reduce", "dp"), ("all_reduce", "tp"), ("all_reduce", "pp"), ("send", "pp"), ("recv", "pp")]
OPS += [("all_gather", "tp"), ("reduce_scatter", "dp-cp"), ("all_to_all", "ep"), ("broadcast", "world")]


def comm(op: str, dim: str, start: float, group) -> CommEvent:
    return CommEvent(op, dim, list(group), 64, "float32", 256, 192.0, start, start + 0.001, "backward", 0)


def pipeline_result(m: int = 12) -> RunResult:
    """A 16-rank dp2 x tp2 x pp4 run whose timeline is the simulator's 1F1B with m microbatches
    (more microbatches than the palette has colours), and communication on every dim."""
    cfg = ParallelConfig(dp=2, tp=2, pp=4, microbatches=m, global_batch=2 * m)
    layout, sim = MeshLayout.of(cfg), tp.simulated(cfg)
    ranks = []
    for r in range(layout.world):
        c = layout.coords(r)
        tl = [
            Event(e["kind"], e["microbatch"], e["chunk"], e["start"], e["end"])
            for e in sim.events
            if e["rank"] == c["pp"]
        ]
        end = max(e.end for e in tl)
        tl += [Event("sync", None, None, end, end + 1), Event("opt", None, None, end + 1, end + 2)]
        events = [comm(op, dim, 0.5 * i, [r, r + 1]) for i, (op, dim) in enumerate(OPS)]
        memory = {"params": 100 + r, "grads": 100, "optimizer": 200, "activations": 50, "gathered": 30, "peak": 500}
        ranks.append(RankReport(r, c, "h", "cpu", memory, events, tl, [1.0]))
    return RunResult(cfg, MODEL, 1, 0, [1.0], ranks)


class Ref:
    losses = [1.0]


def measurement() -> Measurement:
    """A measurement of a user's code: microbatches, the optimizer and regions of their own."""
    ranks = []
    for r in range(4):
        tl = [Event("data", None, None, 0, 1, extra={"region": True})]
        tl += [Event(k, mb, None, 1 + 2 * mb + (k == "B"), 2 + 2 * mb + (k == "B")) for mb in range(3) for k in "FB"]
        tl += [Event("opt", None, None, 8, 9), Event("clip", None, None, 7, 8, extra={"region": True})]
        events = [comm("all_gather", "dp", 1, range(4)), comm("reduce_scatter", "dp", 3, range(4))]
        events += [comm("all_reduce", "ranks 0,2", 5, [0, 2]), comm("all_reduce", "world", 6, range(4))]
        ranks.append(RankReport(r, {"dp": r}, "h", "cpu", {"params": 1, "peak": 2}, events, tl, []))
    return Measurement(ranks, 1)


def every_figure():
    res = pipeline_result()
    est = theory.estimate(ParallelConfig(dp=2, tp=2, ep=2, cp=1, pp=2, microbatches=2, global_batch=8), MOE)
    meas = measurement()
    sched = ParallelConfig(pp=4, microbatches=12, schedule="interleaved", virtual_stages=2, global_batch=12)
    hosts = [f"host{r // 4}" for r in range(16)]
    wide = MODEL.replace(heads=8)  # tp=8 needs heads divisible by 8 (at_scale plans the layout too)
    scale = at_scale(ParallelConfig(dp=32, tp=8, pp=4, microbatches=16, global_batch=512), wide.replace(layers=8))
    flat = at_scale(ParallelConfig(dp=64, tp=8, pp=2, microbatches=16, virtual_stages=1, global_batch=1024), wide)
    yield "memory", figures.memory_figure(res, est)
    yield "memory (estimate)", figures.memory_figure(est, capacity_bytes=1e6)
    yield "comm", figures.comm_figure(res, est)
    yield "comm (estimate)", figures.comm_figure(est)
    yield "traffic", figures.traffic_figure(res)
    yield "timeline", figures.timeline_figure(res)
    yield "loss", figures.loss_figure(res, Ref())
    yield "pipeline", figures.timeline_comparison_figure(res)
    yield "simulated", figures.simulated_timeline_figure(tp.simulated(sched))
    yield "mesh", figures.mesh_figure(MeshLayout.of(ParallelConfig(dp=2, tp=2, pp=4)), "tp", hosts)
    yield "mesh (dp-cp)", figures.mesh_figure(MeshLayout.of(ParallelConfig(dp=4, cp=4)), "dp-cp")
    yield "empty", figures.empty_figure("nothing yet")
    for name, fig in figures.report_figures(meas).items():
        yield f"measurement {name}", fig
    for name, fig in figures.report_figures(res, Ref(), est).items():  # the registry's own, as the report draws them
        yield f"report {name}", fig
    for view in (scale, flat):
        yield "stage memory", theory_figures.stage_memory_figure(view)
        yield "zero", theory_figures.zero_figure(view)
        yield "stage comm", theory_figures.stage_comm_figure(view)
        yield "bubble", theory_figures.bubble_figure(view)
        yield "gpu memory", gpu_memory_figure(view.plan)


def color_of(trace) -> str | None:
    """The colour a trace shows in the legend (its marker's, else its line's), if one string."""
    for part in ("marker", "line"):
        c = getattr(getattr(trace, part, None), "color", None)
        if isinstance(c, str):
            return c.upper()
    return None


def strings(value):
    if isinstance(value, str):
        yield value
    elif value is not None and not isinstance(value, (int, float)):
        for v in value:
            yield from strings(v)


FIGURES = list(every_figure())


def test_the_report_and_the_dashboard_read_one_list_of_figures():
    """widgets/figures.py RUN_FIGURES: a pipeline run draws every figure of it, a measurement those without a
    layout, and the Dashboard has a panel, laid out, for each figure it shows (and the mesh view)."""
    from labkit.widgets.dashboard import NAMES, ROWS

    every = {f.name for f in figures.RUN_FIGURES}
    assert set(figures.report_figures(pipeline_result(), Ref())) == every
    assert set(figures.report_figures(measurement())) == every - {"loss", "pipeline"}
    assert set(NAMES) == {f.name for f in figures.RUN_FIGURES if f.on_dashboard} | {"mesh"}
    assert {n for row in ROWS for n in row} <= set(NAMES)


@pytest.mark.parametrize("name, fig", FIGURES, ids=[n for n, _ in FIGURES])
def test_a_figure_a_person_can_read(name, fig):
    shown = [t for t in fig.data if t.showlegend is not False and t.name]
    names = [t.name for t in shown]
    assert len(names) == len(set(names)), f"{name}: a legend entry twice: {names}"
    colors = {}
    for t in shown:
        c = color_of(t)
        if c is None and t.type in ("bar", "scatter") and getattr(t.marker, "color", None) is None:
            pytest.fail(f"{name}: {t.name!r} has no colour of its own (plotly would pick one by its index)")
        if c is not None:
            assert c not in colors, f"{name}: {t.name!r} and {colors[c]!r} share the colour {c}"
            colors[c] = t.name
    for t in fig.data:
        for field in ("hovertext", "hovertemplate", "text", "name"):
            for text in strings(getattr(t, field, None)):
                assert "None" not in text, f"{name}: {field} of {t.name!r} says None: {text!r}"


def test_the_figures_have_what_the_issue_named():
    """The three cases the issue reported: all_reduce on tp and dp one blue, the timeline's mb 0 /
    all_reduce [pp] and mb 2 / send [pp] alike, and the bubble plot's 'v = 1' twice."""
    by = dict(FIGURES)
    comm = {t.name: color_of(t) for t in by["comm"].data}
    assert comm["all_reduce [tp]"] != comm["all_reduce [dp]"]
    tl = {t.name: color_of(t) for t in by["timeline"].data}
    assert len({tl["mb 0"], tl["all_reduce [pp]"], tl["mb 2"], tl["send [pp]"], tl["mb 10"]}) == 5
    assert [t.name for t in by["bubble"].data].count("v = 1") == 1
    hover = [h for t in by["timeline"].data for h in t.hovertext or ()]
    assert any(h.startswith("F mb=0 chunk=0<br>") for h in hover) and any(h.startswith("opt<br>") for h in hover)


def test_a_palette_never_hands_out_a_colour_twice():
    p = Palette()
    got = [p(f"s{i}", "#4C78A8") for i in range(40)] + [p("s0", "#000000")]
    assert len(set(got[:40])) == 40 and got[40] == got[0] == "#4C78A8"
    assert shade("#4c78a8", 0) == "#4C78A8" and shade("#000000", 1) == "#4C4C4C"


def test_a_live_figure_goes_out_whole_and_its_module_is_small(monkeypatch):
    """anywidget drops every state update of a model whose module takes over 2 s to load: with
    plotly.js inside the module (4.6 MB) that happened on a loaded CI machine, and notebook 08's
    mesh views stayed empty axes (reproduced in chromium by delaying the module 3 s). The module
    must stay small, with plotly.js in one shared model, and a figure's first state must already
    be the figure."""
    import anywidget
    import plotly.graph_objects as go

    from labkit.widgets.live import LiveFigure, plotly_library

    opened = []  # the figure state each model's comm_open carries
    monkeypatch.setattr(LiveFigure, "open", lambda self: opened.append(self._figure) or anywidget.AnyWidget.open(self))
    fig = LiveFigure(go.Figure(go.Bar(y=[1, 2], name="b")), height=300)
    assert len(fig._esm) < 16_000, len(fig._esm)
    assert "PLOTLY_SOURCE" not in fig._esm
    library = plotly_library()
    assert fig._plotly == library.model_id
    assert len(library.source) > 1_000_000 and "Plotly" in library.source[:5000]
    assert LiveFigure(go.Figure())._plotly == library.model_id  # one library per kernel
    assert '"name":"b"' in opened[0] and '"height":300' in opened[0]
