"""The figures of runs on the cluster (widgets/verify_figure.py, experts_figure.py, context_figure.py,
planner_figures.run_links): what each draws is read back from the figure's data and held to the run
it came from (the report's rows and findings, the comm log, comm_table(), the theory's estimate), on
the session's 4-engine cluster."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import TINY
from test_figures_planner import house_style as readable

from labkit import ModelConfig, ParallelConfig, theory
from labkit.widgets import Dashboard, figures
from labkit.widgets.context_figure import cp_traffic
from labkit.widgets.experts_figure import expert_rows, imbalance, token_crossings
from labkit.widgets.planner_figures import LINKS, run_links
from labkit.widgets.style import rank_color
from labkit.widgets.verify_figure import STRIPS, error_ratios, worst_ratios

V, S, B = 64, 8, 8


def small():
    return torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, V))


def batch(step):
    return torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(step))


def loss(model, b):
    return F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())


def data_parallel(model, mesh, average=True, skip=None):
    """Hand-written DDP: every gradient averaged over dp, but `skip`'s left out (a replica bug)."""
    group = mesh.get_group("dp")

    def reduce(g):
        g = g / dist.get_world_size(group) if average else g.clone()
        dist.all_reduce(g, group=group)
        return g

    for name, p in model.named_parameters():
        if name != skip:
            p.register_hook(reduce)
    return model


@pytest.fixture(scope="module")
def reports(lab):
    dp = {"dp": 4}
    return {
        "right": lab.verify(small, data_parallel, dp, batch, loss),
        "summed": lab.verify(small, lambda m, mesh: data_parallel(m, mesh, average=False), dp, batch, loss),
        "norm not reduced": lab.verify(small, lambda m, mesh: data_parallel(m, mesh, skip="1.weight"), dp, batch, loss),
    }


def trace(fig, name):
    return next(t for t in fig.data if t.name == name)


def test_the_verify_figure_draws_every_tensors_error_over_its_bound(reports):
    report = reports["norm not reduced"]
    fig = report.figure()
    readable("verify", fig)
    ticks = fig.layout.xaxis.tickvals
    floor, ceiling = ticks[0], ticks[-1]
    # every tensor's gradient (its worst step) at its error over the bound, in build()'s order
    grads = trace(fig, "gradients")
    assert list(grads.y) == [r["tensor"] for r in report.rows]
    assert list(grads.x) == [r["gradient error"] / r["gradient bound"] for r in report.rows]
    # the final weights: the replay's AdamW took the run's own gradients, so most are exact, drawn at the floor
    assert list(trace(fig, "parameters").x) == [(r["final error"] / report.bounds.params) or floor for r in report.rows]
    # the initial weights must be exact, and are: every point at the floor, which reads '0 (exact)'
    assert set(trace(fig, "initial").x) == {floor} and fig.layout.xaxis.ticktext[0] == "0 (exact)"
    losses = trace(fig, "losses")
    assert list(losses.x) == [r["error"] / r["bound"] for r in report.losses]
    # the unreduced LayerNorm weight is far past its bound, the other tensors under it
    by = dict(zip(grads.y, grads.x))
    assert by["1.weight"] > 1 and all(v < 1 for n, v in by.items() if n != "1.weight")
    # the replica strips: per rank, the tensors whose copy differs, as the findings name them
    strips = trace(fig, "replicas per rank")
    assert list(strips.y) == list(STRIPS)
    for check, row in zip(strips.y, strips.z):
        want = [sum(f.check == check and f.ranks[-1] == r for f in report.findings) for r in range(4)]
        assert list(row) == want, check
    # ranks 1-3 differ from rank 0, at each of the 2 steps (every step's gradients are compared)
    assert list(strips.z[STRIPS.index("gradient replicas")]) == [0, 2, 2, 2]
    # the first failure is marked where it is drawn, and named
    first = report.first()
    assert (first.check, first.tensor) == ("gradient replicas", "1.weight")
    note = next(a for a in fig.layout.annotations if a.text.startswith("first failure"))
    assert note.text == "first failure: [gradient replicas] 1.weight" and (note.x, note.y) == ("r1", first.check)
    assert "verify FAILED on dp=4" in fig.layout.title.text and ceiling > 1 > floor


def test_a_uniform_factor_and_a_pass_are_drawn_as_such(reports):
    summed, right = reports["summed"], reports["right"]
    fig = summed.figure()
    grads = trace(fig, "gradients")
    note = next(a for a in fig.layout.annotations if a.text.startswith("first failure"))
    first = summed.first()
    # the annotation sits on the first failure's point (log axis: its position is log10 of the value)
    assert note.y == first.tensor and note.x == pytest.approx(math.log10(dict(zip(grads.y, grads.x))[first.tensor]))
    assert f"{summed.factor:.4g} × the reference's" in fig.layout.title.text
    ok = right.figure()
    assert all(v < 1 for t in ok.data if t.type == "scatter" for v in t.x if v is not None)
    assert "verify OK on dp=4" in ok.layout.title.text
    assert not [a for a in ok.layout.annotations if a.text.startswith("first failure")]
    # several reports side by side: each check's worst ratio, the passing plan under 1 everywhere
    side = figures.verifies_figure(reports)
    readable("verifies", side)
    for check in ("gradients", "parameters", "losses"):
        drawn = dict(zip(trace(side, check).x, trace(side, check).customdata))
        for name, r in reports.items():
            assert drawn[name] == max(error_ratios(r)[check].values())
    assert worst_ratios(reports["norm not reduced"])["replicas"] == math.inf
    assert dict(zip(trace(side, "replicas").x, trace(side, "replicas").customdata))["right"] == 0
    assert side.layout.title.text.startswith("2 of 3 plans fail")


def test_the_dashboard_draws_the_verdict_beside_a_run(lab, reports):
    report = reports["norm not reduced"]
    res = lab.run(ParallelConfig(dp=4), model=TINY, steps=1)
    dash = Dashboard(lab, model=TINY, run=False)
    try:
        assert "verified" not in dash.figures and not dash.verified.children
        dash.show(res, verified=report)
        drawn = dash.figures["verified"]
        assert dash.verified.children == (drawn,)
        assert [(t.name, list(t.x)) for t in drawn.data if t.type == "scatter"] == [
            (t.name, list(t.x)) for t in report.figure().data if t.type == "scatter"
        ]
        assert "verify FAILED" in dash.status.value
    finally:
        dash.close()


FINE = ModelConfig(
    arch="llama", layers=3, hidden=32, heads=4, kv_heads=2, ffn=128, vocab=128, seq=16,
    experts=8, top_k=2, moe_ffn=16, shared_experts=1, router="sigmoid", n_group=2, topk_group=1,
    routed_scaling_factor=2.5, dense_layers=1, bias_update_speed=0.05,
)  # fmt: skip
"""Notebook 15's DeepSeek-V3-shaped toy: 8 experts, 2 a rank under ep=4, two MoE blocks."""


def test_the_experts_figure_draws_the_rows_each_rank_received(lab):
    cfg = ParallelConfig(ep=4)
    runs = {
        "frozen": lab.run(cfg, model=FINE.replace(bias_update_speed=0.0), steps=3, return_params=True),
        "moving": lab.run(cfg, model=FINE, steps=3, return_params=True),
    }
    for res in runs.values():
        rows = expert_rows(res)
        assert rows.shape == (3, FINE.moe_layers, 4)
        # every assignment (b·s tokens, top_k each) arrives at exactly one rank: the ranks' rows add up
        assert (rows.sum(axis=2) == cfg.global_batch * FINE.seq * FINE.top_k).all()
    # step 0 routes with the same weights and a zero bias in both runs; then the moving bias moves the load
    a, b = expert_rows(runs["frozen"]), expert_rows(runs["moving"])
    assert (a[0] == b[0]).all() and (a[1:] != b[1:]).any()
    fig = figures.expert_load_figure(runs)
    readable("experts", fig)
    for name, res in runs.items():
        heat = next(t for t in fig.data if t.type == "heatmap" and t.name == name)
        rows = expert_rows(res)
        assert np.array_equal(np.asarray(heat.z), rows.reshape(3, -1))
        assert list(heat.x[:4]) == ["b1 r0", "b1 r1", "b1 r2", "b1 r3"]
        for layer in range(FINE.moe_layers):
            line = trace(fig, f"{name}, b{layer + 1}")
            assert list(line.y) == list(imbalance(rows)[:, layer])
            assert list(line.y) == [max(r) * 4 / sum(r) for r in rows[:, layer, :]]
            assert list(line.marker.color) == [rank_color(int(r)) for r in rows[:, layer, :].argmax(axis=1)]
    # the moving run's biases are drawn as trained; the frozen run's are zero and say so instead
    for key, bias in runs["moving"].buffers.items():
        drawn = trace(fig, f"moving, b{key.split('.')[1]} bias")
        assert list(drawn.y) == list(np.asarray(bias, dtype=float).reshape(-1))
    assert not [t for t in fig.data if (t.name or "").startswith("frozen") and t.name.endswith("bias")]


def test_token_crossings_count_what_leaves_a_node():
    """Against a token-by-token count of the same routing (b, s, k)."""
    gen = np.random.default_rng(0)
    chosen = gen.integers(0, 8, size=(8, 16, 2))
    got = token_crossings(chosen, experts_per_rank=2, ranks_per_node=2, seqs_per_rank=2)
    rows_away = tokens_away = reaching = 0
    for seq in range(8):
        home = (seq // 2) // 2  # rank seq // 2 routes it; node = rank // 2
        for tok in range(16):
            nodes = [(int(e) // 2) // 2 for e in chosen[seq, tok]]
            rows_away += sum(n != home for n in nodes)
            tokens_away += any(n != home for n in nodes)
            reaching += len(set(nodes)) > 1
    assert got == {
        "rows": 8 * 16 * 2,
        "rows across nodes": rows_away,
        "tokens across nodes": tokens_away,
        "tokens reaching 2+ nodes": reaching,
    }
    limited = np.where(chosen < 4, chosen, chosen - 4)  # every token's experts on node 0
    fig = figures.token_crossing_figure({"unlimited": [got], "limited": [token_crossings(limited, 2, 2, 2)]})
    readable("token crossings", fig)
    assert list(trace(fig, "unlimited: tokens reaching 2+ nodes").y) == [reaching]
    assert list(trace(fig, "limited: tokens reaching 2+ nodes").y) == [0]


def test_the_context_kinds_figure_draws_measured_beside_theory(lab):
    gqa = TINY.replace(arch="llama", hidden=64, heads=8, kv_heads=4)
    kinds = {}
    for kind in ("ring", "allgather", "ulysses", "hierarchical"):
        cfg = ParallelConfig(cp=4, cp_kind=kind, cp_a2a=2 if kind == "hierarchical" else 1)
        kinds[kind] = (lab.run(cfg, model=gqa, steps=1), theory.estimate(cfg, gqa))
    fig = figures.context_kinds_figure(kinds)
    readable("context kinds", fig)
    for op in ("send", "all_gather", "reduce_scatter", "all_to_all"):
        drawn = dict(zip(zip(*trace(fig, op).x), trace(fig, op).y))
        for kind, (res, est) in kinds.items():
            rows = [r for r in res.comm_table() if (r["rank"], r["dim"], r["op"]) == (0, "cp", op)]
            assert drawn[kind, "measured"] == sum(r["wire_bytes"] for r in rows) / 1024
            assert drawn[kind, "theory"] == cp_traffic(est).get(op, 0.0) / 1024
    assert drawn["ulysses", "measured"] > 0 and drawn["ring", "measured"] == 0  # all_to_all: Ulysses' only
    acts = dict(zip(zip(*trace(fig, "activations").x), trace(fig, "activations").y))
    for kind, (res, _) in kinds.items():
        assert acts[kind, "measured"] == max(rk.memory["activations"] for rk in res.ranks) / 1024
    assert "every bar equals its theory" in fig.layout.title.text


def test_a_runs_links_split_hsdp_and_flat_fsdp_by_node(lab):
    """Notebook 03's 2-rank "nodes": HSDP's replicas cross, its shard groups do not; flat FSDP's ring
    over 4 ranks on 2 nodes crosses at 2 of its 4 hops."""
    runs = {
        "FSDP": lab.run(ParallelConfig(dp=4, sharding="fsdp"), model=TINY, steps=1),
        "HSDP": lab.run(ParallelConfig(dp=4, dp_replicate=2, sharding="fsdp"), model=TINY, steps=1),
    }
    links = {name: {r["dim"]: r for r in run_links(res, ranks_per_node=2)} for name, res in runs.items()}
    sent = {name: {} for name in runs}
    for name, res in runs.items():
        for r in res.comm_table():
            if r["rank"] == 0:  # a dim's ops summed: FSDP's all-gathers and reduce-scatters
                sent[name][r["dim"]] = sent[name].get(r["dim"], 0.0) + r["wire_bytes"]
    assert links["HSDP"]["dp_replicate"]["GB across nodes"] == sent["HSDP"]["dp_replicate"] / 1e9
    assert links["HSDP"]["dp_shard"]["GB across nodes"] == 0
    assert links["FSDP"]["dp"]["GB across nodes"] == pytest.approx(sent["FSDP"]["dp"] / 2 / 1e9)
    fig = figures.links_figure({name: run_links(res, 2) for name, res in runs.items()}, unit="kB")
    readable("run links", fig)
    drawn = dict(zip(zip(*trace(fig, "dp_replicate").y), trace(fig, "dp_replicate").x))
    assert drawn["HSDP", LINKS[1]] == pytest.approx(sent["HSDP"]["dp_replicate"] / 1e3)
    assert "least across nodes: HSDP" in fig.layout.title.text
