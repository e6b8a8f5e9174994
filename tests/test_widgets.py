"""Widget logic without a browser: controls set as a person would, figures and results read back.

The dashboard runs on the session's real 4-engine cluster; MeshView and ScaleExplorer need
none. Expected numbers come from the ring model and the theory, never typed in.
"""

from __future__ import annotations

import html
import time

import numpy as np
import pytest
from conftest import TINY

from labkit import ConfigError, ModelConfig, ParallelConfig, theory, validate
from labkit.config.validation import problems
from labkit.layout.mesh import MeshLayout
from labkit.theory.presets import PRESETS, PUBLISHED_PARAMS
from labkit.widgets import Dashboard, MeshView, ScaleExplorer, figures
from labkit.widgets.controls import DEGREES
from labkit.widgets.scale import at_scale

PSI = theory.num_params(TINY)
KIB = 1024


@pytest.fixture
def dash(lab):
    d = Dashboard(lab, model=TINY, debounce=0.05)
    d.wait(120)
    yield d
    d.close()


def bars(fig, name):
    """y values of the trace called `name`."""
    return list(next(t for t in fig.data if t.name == name).y)


def ring_all_reduce(n: int, payload: float) -> float:
    return 2 * (n - 1) / n * payload


# -- the dashboard on the cluster ----------------------------------------------------------------
def test_first_run_draws_every_figure(dash, ref_cache):
    res = dash.result
    assert res.config == ParallelConfig(dp=4) and dash.error is None
    assert set(dash.figures) == {"memory", "comm", "traffic", "timeline", "mesh", "loss"}
    mem = dash.figures["memory"]
    for cat in ("params", "grads", "optimizer", "activations"):
        assert bars(mem, cat) == [rk.memory[cat] / KIB for rk in res.ranks]
    assert bars(mem, "params") == [4 * PSI / KIB] * 4  # fp32 weights, every rank
    assert bars(dash.figures["comm"], "all_reduce [dp]") == [ring_all_reduce(4, 4 * PSI) / KIB] * 4
    assert bars(dash.figures["loss"], "reference (1 process)") == ref_cache().losses
    assert bars(dash.figures["loss"], "lab layout") == res.losses
    timeline = dash.figures["timeline"]
    assert {"mb 0", "all_reduce [dp]"} <= {t.name for t in timeline.data}
    assert timeline.layout.title.text.startswith("Timeline, step 3")
    ranks = [r for t in dash.figures["mesh"].data if t.customdata is not None for r in t.customdata]
    assert sorted(ranks) == [0, 1, 2, 3]
    assert "done" in dash.status.value and dash.progress.value == 3


def test_dp_4_to_2_changes_the_comm_figure_in_place(dash):
    before = {name: id(fw) for name, fw in dash.figures.items()}
    dash.controls["dp"].value = 2
    res = dash.wait(60)
    assert res.config.dp == 2 and len(res.ranks) == 2  # ranks 2 and 3 idle
    assert {name: id(fw) for name, fw in dash.figures.items()} == before  # same widgets, redrawn
    assert bars(dash.figures["comm"], "all_reduce [dp]") == [ring_all_reduce(2, 4 * PSI) / KIB] * 2
    assert list(dash.figures["traffic"].data[0].x) == ["r0", "r1"]
    assert bars(dash.figures["memory"], "activations") == [rk.memory["activations"] / KIB for rk in res.ranks]


def test_invalid_layout_shows_its_error_and_does_not_run(dash):
    runs, shown = dash.runs, dash.result
    dash.controls["sequence_parallel"].value = True  # needs tp > 1
    cfg = ParallelConfig(dp=4, sequence_parallel=True)
    with pytest.raises(ConfigError) as err:
        validate(cfg, TINY, 4)
    assert html.escape(str(err.value)) in dash.error_box.value
    assert "not run" in dash.status.value
    assert dash.wait(10) is shown and dash.runs == runs
    dash.controls["sequence_parallel"].value = False  # valid again: it runs
    assert dash.wait(60) is not shown and dash.error_box.value == ""


def test_controls_offer_only_values_that_fit(dash):
    c = dash.controls
    # dp=4 fills the 4 engines: no other degree can grow; microbatches m must split 8 / (dp=4)
    assert [c[d].options for d in ("tp", "pp", "cp", "ep")] == [(1,)] * 4
    assert c["microbatches"].options == tuple(m for m in range(1, 65) if 8 % (4 * m) == 0)
    c["dp"].value = 2
    dash.wait(60)
    cfg = dash.result.config
    for d in DEGREES:
        fits = tuple(v for v in range(1, 5) if not problems(cfg.replace(**{d: v}), TINY, 4))
        assert c[d].options == fits, d
    assert c["tp"].options == (1, 2)  # 2 * tp <= 4, tp | heads
    assert c["ep"].options == (1,)  # a dense model has no experts
    assert all(not w.continuous_update for w in c.values() if hasattr(w, "continuous_update"))


def test_microbatches_show_on_the_timeline(dash):
    dash.controls["dp"].value = 2
    dash.controls["microbatches"].value = 4  # debounced into one run
    res = dash.wait(60)
    assert (res.config.dp, res.config.microbatches) == (2, 4)
    names = {t.name for t in dash.figures["timeline"].data}
    assert {f"mb {i}" for i in range(4)} <= names
    # one all-reduce per step whatever the microbatches (gradient accumulation)
    assert bars(dash.figures["comm"], "all_reduce [dp]") == [ring_all_reduce(2, 4 * PSI) / KIB] * 2


def test_pipeline_changes_memory_comm_and_timeline(lab):
    """The issue's check: pp 1 -> 4 and microbatches 8 on 4 engines re-runs and redraws."""
    model = ModelConfig(layers=4, hidden=32, heads=4, ffn=128, vocab=128, seq=16)
    cfg = ParallelConfig(pp=4, microbatches=8)
    try:
        validate(cfg, model, 4)
    except ConfigError as e:
        pytest.skip(f"the engines refuse this layout today: {e.problems}")
    d = Dashboard(lab, model=model, debounce=0.05)
    try:
        d.wait(120)
        before = {n: d.figures[n].to_plotly_json()["data"] for n in ("memory", "comm", "timeline")}
        d.controls["dp"].value = 1
        d.controls["pp"].value = 4
        d.controls["microbatches"].value = 8
        res = d.wait(120)
        assert (res.config.pp, res.config.microbatches) == (4, 8) and d.error is None
        for n, data in before.items():
            assert d.figures[n].to_plotly_json()["data"] != data, n
        assert {f"mb {i}" for i in range(8)} <= {t.name for t in d.figures["timeline"].data}
    finally:
        d.close()


SLOW = ModelConfig(layers=6, hidden=256, heads=4, ffn=1024, vocab=256, seq=128)
"""0.2 s a step on one CPU rank, so 20 steps outlast a cancel's round trip: TINY's 20 steps took
0.1 s, and on a busy machine the cancel came after the run had ended (a CI failure)."""


def test_cancel_stops_the_run_and_the_next_one_works(lab):
    """The cancel button stops a long run; the figures keep the last finished one.

    On one rank: with several, Lab.cancel can stop one rank at a step boundary while the others
    already wait in that step's all-reduce (a hang until the Lab's timeout, then a restart) —
    a race in the engines' cancel, reported; the dashboard's wiring is what this tests."""
    dash = Dashboard(lab, model=SLOW, debounce=0.05)
    try:
        dash.wait(120)
        dash.controls["dp"].value = 1
        shown = dash.wait(120)
        dash.controls["steps"].value = 20
        deadline = time.monotonic() + 60
        while not (dash.running and dash.progress.value >= 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not dash.cancel_button.disabled
        dash.cancel_button.click()
        dash.wait(120)
        assert "cancelled" in dash.status.value, (dash.status.value, dash.error_box.value)
        assert dash.result is shown
        dash.controls["steps"].value = 2
        assert dash.wait(60).steps == 2
    finally:
        dash.close()


# -- figures from a measured run ------------------------------------------------------------------
def test_refresh_shows_exactly_the_new_figure(lab):
    from labkit.widgets.live import figure_widget, refresh, same

    a = lab.run(ParallelConfig(dp=4), model=TINY, steps=2)
    b = lab.run(ParallelConfig(dp=2, microbatches=2), model=TINY, steps=2)

    def plain(fig_json):  # uids are the widget's own; an empty list is the same as no list
        for t in fig_json["data"]:
            t.pop("uid", None)
        return [
            {k: v for k, v in d.items() if not (isinstance(v, (list, tuple)) and not v)}
            for d in fig_json["data"] + [fig_json["layout"]]
        ]

    builders = [
        lambda r: figures.memory_figure(r, theory.estimate(r.config, r.model), 1e6 if r is a else None),
        figures.comm_figure,
        figures.traffic_figure,
        figures.timeline_figure,
        figures.loss_figure,
        lambda r: figures.mesh_figure(MeshLayout.of(r.config), "dp"),
    ]
    for build in builders:
        fw = figure_widget(figures.empty_figure("before"))
        for r in (a, b, a, a, b):
            fig = build(r)
            refresh(fw, fig)
            assert same(plain(fw.to_plotly_json()), plain(fig.to_plotly_json()))


def test_traffic_matrix_follows_the_ring(lab):
    res = lab.run(ParallelConfig(dp=4, bucket_mb=0.03), model=TINY, steps=2)
    ranks, m = figures.traffic_matrix(res)
    sent = {r: sum(row["wire_bytes"] for row in res.comm_table() if row["rank"] == r) for r in ranks}
    assert m.sum(axis=1).tolist() == [sent[r] for r in ranks]  # rows add up to comm_table
    ring = np.zeros_like(m)
    for i in range(4):
        ring[i, (i + 1) % 4] = ring_all_reduce(4, 4 * PSI)  # each rank feeds its successor
    assert np.allclose(m, ring)
    fig = figures.traffic_figure(res)
    assert np.allclose(np.asarray(fig.data[0].z), m / KIB)
    cap = figures.memory_figure(res, capacity_bytes=80e9)
    assert [s.y0 for s in cap.layout.shapes] == [80e9 / KIB]


def test_figures_draw_an_estimate_too():
    est = theory.estimate(ParallelConfig(dp=4), TINY)
    mem = figures.memory_figure(est)
    assert bars(mem, "params") == [m["params"] / KIB for m in est.memory]
    comm = figures.comm_figure(est)
    assert bars(comm, "all_reduce [dp]") == [ring_all_reduce(4, 4 * PSI) / KIB] * 4


# -- MeshView: no cluster ----------------------------------------------------------------------------
def test_mesh_view_groups_orders_and_hosts():
    view = MeshView(ParallelConfig(dp=4, tp=2, pp=2), dim="tp")
    layout = MeshLayout.from_sizes(dp=4, tp=2, pp=2)
    assert view.groups == layout.groups("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    view.controls["dim"].value = "dp"
    assert view.groups == layout.groups("dp")
    view.controls["order"].value = "dp-tp-cp-ep-pp"  # dp innermost now
    assert view.groups == [[4 * i + k for k in range(4)] for i in range(4)]
    view.controls["order"].value = "dp-tp"
    assert "must name each of" in view.text.value
    view.controls["order"].value = "tp-cp-ep-dp-pp"
    view.controls["ranks_per_host"].value = 4  # 4 hosts of 4 ranks
    crossing = next(t for t in view.figure.data if t.name == "dp group spans hosts")
    hosts = [r // 4 for r in range(16)]
    expect = sorted(r for g in layout.groups("dp") if len({hosts[x] for x in g}) > 1 for r in g)
    assert sorted(crossing.customdata) == expect == list(range(16))  # dp strides over nodes
    view.controls["dim"].value = "tp"
    assert not any(t.name == "tp group spans hosts" for t in view.figure.data)  # tp stays in a node


def test_mesh_figure_draws_16k_ranks():
    """Its speed is benchmarks/speed.py's (benchmarks/RESULTS.md), not a bound here."""
    layout = MeshLayout.from_sizes(tp=8, dp=256, pp=8)
    fig = figures.mesh_figure(layout, "tp")
    assert sum(len(t.x) for t in fig.data if t.customdata is not None) == 16384


# -- ScaleExplorer: theory only ----------------------------------------------------------------------
def test_presets_hold_the_published_parameter_counts():
    for name, model in PRESETS.items():  # exact now: GPT-2's head is tied as published (tests/test_hf.py)
        assert theory.num_params(model) == PUBLISHED_PARAMS[name], name


def test_at_scale_agrees_with_the_full_estimate():
    for cfg in (ParallelConfig(dp=8, global_batch=8), ParallelConfig(dp=4, tp=2, pp=2, global_batch=8)):
        model = ModelConfig()
        est = theory.estimate(cfg, model)
        view = at_scale(cfg, model)
        assert view.memory == [est.memory[r] for r in view.ranks]
        for rank, rows in zip(view.ranks, view.comm):
            full = [r for r in est.comm_table() if r["rank"] == rank]
            assert {(r["dim"], r["op"]): r["wire_bytes"] for r in rows} == pytest.approx(
                {(r["dim"], r["op"]): r["wire_bytes"] for r in full}
            )


def test_scale_explorer_follows_its_controls_and_reaches_16k_gpus():
    """Each change redraws without an error; how fast is benchmarks/speed.py's (benchmarks/RESULTS.md)."""
    x = ScaleExplorer(model="llama-7b", gpus=64, tp=8)
    c = x.controls
    for field, value in [
        ("microbatches", 4),
        ("pp", 2),
        ("sharding", "zero1"),
        ("precision", "fp32"),
        ("gpus", 128),
        ("tp", 4),
        ("pp", 4),
        ("microbatches", 16),
        ("gpus", 256),
        ("cp", 2),
    ]:
        c[field].value = value
        x.wait()
        assert x.error_box.value == "", (field, value, x.error_box.value)
    c["pp"].value, c["cp"].value, c["tp"].value, c["precision"].value = 1, 1, 8, "fp32"
    c["sharding"].value = "none"  # DDP: one all-reduce of the fp32 gradients over dp
    c["gpus"].value = 16384
    view = x.wait(120)
    assert view.config.world == 16384 and not view.comm_pending
    n = view.config.dp
    dp_rows = [r for r in view.comm[0] if r["op"] == "all_reduce" and r["dim"] == "dp"]
    from labkit.theory.exact.params import rank_param_count

    held = rank_param_count(view.config, view.model, 0)  # the rank's tp slice of the model
    assert held < view.psi / 7  # tp=8: about an eighth (norms replicated)
    assert [r["wire_bytes"] for r in dp_rows] == [ring_all_reduce(n, 4 * held)]  # DDP's fp32 gradients
    assert x.figures["memory"].layout.shapes[0].y0 == 80  # the 80 GB line
    c["tp"].value = 16  # llama-7b: heads 32; dp = 16384 / 16 = 1024
    assert x.view.config.dp == 1024
    c["gpus"].value = 1  # dp would not be whole
    assert "not divisible" in x.error_box.value
