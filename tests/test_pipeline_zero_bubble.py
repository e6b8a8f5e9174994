"""Zero-bubble schedules (ZB-H1, ZB-V, DualPipeV) and FSDP / ZeRO-2/3 under pipeline parallelism
on the 4-engine gloo cluster: every layout trains like one process (labkit.oracle.checks against the
fp32 reference), measures what the theory predicts to the byte (model states, activations, what
W holds, the gathered stages and their gradient buffers, every collective), and runs its schedule:
the timeline's F, B and W in the schedule's order. impl='torch' runs PyTorch's zero-bubble schedules
on the same chunks."""

from __future__ import annotations

import pytest
from conftest import TINY
from theory_match import same_p2p_as_ours

from labkit import ParallelConfig, theory
from labkit.layout.schedules import schedule_table
from labkit.oracle.checks import assert_matches

M4 = TINY.replace(layers=4)  # pp=2: one layer per V chunk; pp=4: one per stage
M8 = TINY.replace(layers=8)  # pp=4 in a V: one layer per chunk
P = ParallelConfig


@pytest.fixture(scope="module")
def run(lab, ref_cache):
    """lab.run(...) of a layout, checked against the reference."""

    def get(cfg: ParallelConfig, model):
        res = lab.run(cfg, model=model, steps=3, return_params=True)
        assert_matches(res, ref_cache(model=model, global_batch=cfg.global_batch))
        return res

    return get


def check_theory_and_schedule(res, cfg: ParallelConfig, model) -> None:
    """Every memory category and every comm row equal the estimate; each rank ran its schedule."""
    est = theory.estimate(cfg, model, world=4)
    assert res.comm_table() == est.comm_table()
    table = schedule_table(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages)
    for rk in res.ranks:
        want = {k: v for k, v in est.memory[rk.rank].items() if k != "peak"}
        assert {k: v for k, v in rk.memory.items() if k != "peak"} == want, rk.rank
        step = [e for e in rk.timeline if e.step == 2]
        ran = [(e.kind, e.microbatch, e.chunk) for e in step if e.kind in ("F", "B", "W")]
        assert ran == [(a.op, a.mb, a.chunk) for a in table.compute(rk.coords["pp"])], rk.rank


ZERO_BUBBLE = [
    (P(pp=4, microbatches=4, schedule="zbh1"), M4),
    (P(pp=2, dp=2, microbatches=2, schedule="zbh1", sharding="zero1"), M4),
    (P(pp=2, tp=2, microbatches=2, schedule="zbh1"), M4),
    (P(pp=4, virtual_stages=2, microbatches=4, schedule="zbv"), M8),
    (P(pp=2, tp=2, virtual_stages=2, microbatches=2, schedule="zbv", sequence_parallel=True), M4),
    (P(pp=2, dp=2, virtual_stages=2, microbatches=2, schedule="zbv", sharding="fsdp"), M4),
    (P(pp=4, virtual_stages=2, microbatches=8, schedule="dualpipev"), M8),
    (P(pp=2, dp=2, virtual_stages=2, microbatches=4, schedule="dualpipev"), M4),
    (P(pp=2, tp=2, virtual_stages=2, microbatches=4, schedule="dualpipev"), M4),
]


def name(case) -> str:
    cfg = case[0] if isinstance(case, tuple) else case
    extra = "".join(f"x{d}{getattr(cfg, d)}" for d in ("dp", "tp") if getattr(cfg, d) > 1)
    return f"{cfg.schedule}-pp{cfg.pp}{extra}-m{cfg.microbatches}-{cfg.sharding}"


@pytest.mark.parametrize("cfg, model", ZERO_BUBBLE, ids=[name(c) for c in ZERO_BUBBLE])
def test_zero_bubble_schedules_train_like_one_process_and_as_predicted(run, cfg, model):
    res = run(cfg, model)
    check_theory_and_schedule(res, cfg, model)
    # B and W told apart: every microbatch's W comes after its B, on every rank
    for rk in res.ranks:
        step = [(e.kind, e.microbatch, e.chunk) for e in rk.timeline if e.step == 2]
        for kind, mb, chunk in step:
            if kind == "W":
                assert step.index(("B", mb, chunk)) < step.index(("W", mb, chunk))


SHARDED = [
    P(pp=2, dp=2, microbatches=2, schedule="1f1b", sharding="fsdp"),
    P(pp=2, dp=2, microbatches=2, schedule="interleaved", virtual_stages=2, sharding="fsdp"),
    P(pp=2, dp=2, microbatches=2, schedule="zbh1", sharding="fsdp", precision="bf16"),
    P(pp=2, dp=2, microbatches=2, schedule="1f1b", sharding="zero3", precision="bf16"),
    P(pp=2, dp=2, microbatches=2, schedule="interleaved", virtual_stages=2, sharding="zero3"),
    P(pp=2, dp=2, microbatches=2, schedule="zbh1", sharding="zero3"),
    P(pp=2, dp=2, microbatches=2, schedule="1f1b", sharding="zero2"),
]


@pytest.mark.parametrize("cfg", SHARDED, ids=[name(c) + "-" + c.precision for c in SHARDED])
def test_sharded_data_parallel_under_a_pipeline_reduces_once_per_step(run, cfg):
    """FSDP and ZeRO-3 keep each unit gathered from its first forward to its last backward and
    reduce-scatter it once; ZeRO-2 sums every microbatch into its bucket and reduce-scatters it
    once: per step one all-gather (ZeRO-3 / FSDP; ZeRO-2: after the update) and one reduce-scatter
    per buffer, none before the last backward of its chunk."""
    res = run(cfg, M4)
    check_theory_and_schedule(res, cfg, M4)
    for rk in res.ranks:
        step = [c for c in rk.comm if c.step == 2 and c.dim == "dp"]
        backwards = [e for e in rk.timeline if e.step == 2 and e.kind in ("B", "W")]
        last = {c: max(e.start for e in backwards if e.chunk == c) for c in range(cfg.virtual_stages)}
        scatters = [c for c in step if c.op == "reduce_scatter"]
        assert scatters and all(c.start >= min(last.values()) for c in scatters)


TORCH = [
    P(pp=2, microbatches=2, schedule="zbh1", impl="torch"),
    P(pp=4, microbatches=4, schedule="zbh1", impl="torch"),
    P(pp=2, virtual_stages=2, microbatches=2, schedule="zbv", impl="torch"),
    P(pp=2, virtual_stages=2, microbatches=4, schedule="dualpipev", impl="torch"),
]


@pytest.mark.parametrize("cfg", TORCH, ids=[name(c) for c in TORCH])
def test_torch_zero_bubble_schedules_train_like_one_process(run, cfg):
    """ScheduleInterleavedZeroBubble (ZB1P: our zbh1), ScheduleZBVZeroBubble and ScheduleDualPipeV
    on the same chunks: the same training, the same point-to-point volume as ours, B and W spans.
    (With dp > 1 PyTorch's DDP never sees the weight gradients, which the stage's W writes into
    .grad itself: labkit refuses it, test_schedules_zero_bubble.py.)"""
    res = run(cfg, M4)
    same_p2p_as_ours(res, cfg, M4)
    kinds = {e.kind for rk in res.ranks for e in rk.timeline}
    assert {"F", "B", "W"} <= kinds
