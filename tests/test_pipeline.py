"""Pipeline parallelism on a real 4-engine gloo cluster: ours (GPipe, 1F1B, interleaved 1F1B)
and torch.distributed.pipelining, against the one-process reference and the theory."""

from __future__ import annotations

import pytest
from conftest import TINY
from theory_match import same_p2p_as_ours

from labkit import ParallelConfig, theory
from labkit.layout.schedules import schedule_table
from labkit.oracle.checks import assert_matches

M4 = TINY.replace(layers=4)  # 4 layers: one per stage at pp=4, one per chunk at pp=2 x v=2


@pytest.fixture(scope="module")
def run(lab, ref_cache):
    """lab.run(...) of each layout once per module, checked against the reference."""
    cache = {}

    def get(cfg: ParallelConfig, model=M4):
        key = (cfg, model)
        if key not in cache:
            res = lab.run(cfg, model=model, steps=3, return_params=True)
            assert_matches(res, ref_cache(model=model, global_batch=cfg.global_batch))
            cache[key] = res
        return cache[key]

    return get


def comm_rows(rows):
    return [(r["rank"], r["dim"], r["op"], r["calls"], r["payload_bytes"], r["wire_bytes"]) for r in rows]


LAYOUTS = [
    ParallelConfig(pp=4, microbatches=4, schedule="gpipe"),
    ParallelConfig(pp=4, microbatches=8, schedule="gpipe"),
    ParallelConfig(pp=4, microbatches=4, schedule="1f1b"),
    ParallelConfig(pp=4, microbatches=8, schedule="1f1b"),
    ParallelConfig(pp=4, microbatches=6, schedule="gpipe", global_batch=12),  # m not a multiple of p
    ParallelConfig(pp=4, microbatches=6, schedule="1f1b", global_batch=12),
    ParallelConfig(pp=2, dp=2, microbatches=2, schedule="1f1b"),
    ParallelConfig(pp=2, virtual_stages=2, microbatches=4, schedule="interleaved"),
]


@pytest.mark.parametrize("cfg", LAYOUTS, ids=lambda c: f"pp{c.pp}xdp{c.dp}-{c.schedule}-m{c.microbatches}")
def test_pipeline_trains_like_one_process_and_as_predicted(run, cfg):
    res = run(cfg)  # losses and parameters match the reference
    est = theory.estimate(cfg, M4)
    assert comm_rows(res.comm_table()) == comm_rows(est.comm_table())  # row for row, calls too
    table = schedule_table(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    for rk in res.ranks:
        for k in ("params", "grads", "optimizer", "activations"):
            assert rk.memory[k] == est.memory[rk.rank][k], (rk.rank, k)
        # the executor ran this rank's list: F/B in the schedule's order, one send/recv span per message
        step = [e for e in rk.timeline if e.step == 2]
        ran = [(e.kind, e.microbatch, e.chunk) for e in step if e.kind in ("F", "B")]
        assert ran == [(a.op, a.mb, a.chunk) for a in table.compute(rk.coords["pp"])]
        for kind in ("send", "recv"):
            assert len([e for e in step if e.kind == kind]) == len(
                [a for a in table.actions[rk.coords["pp"]] if a.op.startswith(kind)]
            )
    bubble = res.bubble_fraction()
    assert set(bubble["per_rank"]) == {rk.rank for rk in res.ranks}
    assert all(0 < f < 1 for f in bubble["per_rank"].values())


def test_first_stage_activations_gpipe_holds_m_1f1b_holds_p(run):
    """GPipe keeps all m microbatches of the first stage alive, 1F1B at most p: the measured
    peaks differ by m/p (within 10%) and equal the prediction."""
    p, m = 4, 8
    g = run(ParallelConfig(pp=p, microbatches=m, schedule="gpipe"))
    o = run(ParallelConfig(pp=p, microbatches=m, schedule="1f1b"))
    first = [rk for rk in g.ranks if rk.coords["pp"] == 0][0].rank
    ratio = g.ranks[first].memory["activations"] / o.ranks[first].memory["activations"]
    assert ratio == pytest.approx(m / p, rel=0.10)
    # 1F1B: p - stage microbatches in flight, so the peak falls along the pipeline
    peaks = [rk.memory["activations"] for rk in sorted(o.ranks, key=lambda rk: rk.coords["pp"])]
    assert peaks[0] > peaks[1] > peaks[2]


def test_each_chunk_is_reduced_once_after_its_last_backward(run):
    """pp=2 x dp=2: each rank's dp all-reduces (one per bucket) start after its last backward
    has begun (DDP launches them from the gradient hooks of the last microbatch), once per step."""
    cfg = ParallelConfig(pp=2, dp=2, microbatches=2, schedule="1f1b")
    res = run(cfg)
    est_calls = {(r["rank"], r["dim"]): r["calls"] for r in theory.estimate(cfg, M4).comm_table()}
    for rk in res.ranks:
        step = [e for e in rk.timeline if e.step == 2]
        last_b = max(e.start for e in step if e.kind == "B")
        reduces = [c for c in rk.comm if c.step == 2 and c.dim == "dp"]
        assert len(reduces) == est_calls[(rk.rank, "dp")]
        assert all(c.start >= last_b and c.phase == "backward" for c in reduces)


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(pp=4, microbatches=4, schedule="1f1b", impl="torch"),
        ParallelConfig(pp=2, dp=2, microbatches=4, schedule="gpipe", impl="torch"),
        ParallelConfig(pp=2, virtual_stages=2, microbatches=4, schedule="interleaved", impl="torch"),
    ],
    ids=lambda c: f"torch-pp{c.pp}xdp{c.dp}-{c.schedule}",
)
def test_torch_pipelining_trains_like_one_process(run, cfg):
    res = run(cfg)
    same_p2p_as_ours(res, cfg, M4)
    assert any(e.kind == "F" for rk in res.ranks for e in rk.timeline)


def test_measured_and_simulated_timelines_side_by_side(run):
    from labkit.theory.exact.pipeline import costs_from_result, simulated
    from labkit.widgets.figures import report_figures, timeline_comparison_figure

    cfg = ParallelConfig(pp=2, dp=2, microbatches=2, schedule="1f1b")
    res = run(cfg)
    costs = costs_from_result(res)
    assert set(costs["F"]) == {0, 1} and all(t > 0 for t in costs["F"].values())
    sim = simulated(cfg, costs)
    assert not sim.problems and sim.makespan > 0
    fig = timeline_comparison_figure(res, sim)
    rows = {b.y[0] for b in fig.data if b.name.startswith("mb ")}
    assert rows == {f"rank {rk.rank}" for rk in res.ranks} | {"rank 0 (sim)", "rank 2 (sim)"}
    assert "pipeline" in report_figures(res)
