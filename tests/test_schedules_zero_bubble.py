"""Zero-bubble schedules and FSDP x PP on paper (pure: no torch, no cluster): the orders against
their published bubbles and memory, the V placement, what the theory predicts for them, and
torchtitan's Llama 3.1 405B layout (FSDP8 x TP8 x PP8) estimated."""

from __future__ import annotations

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.config import ConfigError
from labkit.config.validation import validate
from labkit.layout.schedules import chunk_layers, rank_chunk_of, schedule_table, stage_of
from labkit.layout.simulator import Costs, simulate
from labkit.theory.exact import pipeline as tp
from labkit.theory.exact import sharding
from labkit.theory.presets import LLAMA31_405B

M8 = ModelConfig(layers=8, hidden=32, heads=4, ffn=128, vocab=128, seq=16)


def idle(sim) -> tuple[set, set]:
    """Per rank: idle time in the pipeline's window (first to last compute of any rank, what
    RunResult.bubble_fraction measures) and in the rank's own window (its first to its last compute)."""
    own = {}
    for e in sim.events:
        if e["kind"] in ("F", "B", "W"):
            a, b = own.get(e["rank"], (e["start"], e["end"]))
            own[e["rank"]] = (min(a, e["start"]), max(b, e["end"]))
    return {sim.makespan - sim.busy[r] for r in sim.busy}, {b - a - sim.busy[r] for r, (a, b) in own.items()}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbh1_bubble_is_qi_table_2_for_any_costs_where_w_is_cheapest(p):
    """Qi et al. (ICLR 2024), table 2: ZB-H1 idles (p-1)(t_F + t_B - t_W) per rank (m >= p), 1F1B
    (p-1)(t_F + t_B + t_W) with backward split the same way."""
    for f, b, w in [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 1)]:
        for m in (p, 3 * p):
            pipeline, _ = idle(simulate(schedule_table("zbh1", p, m), Costs(f, b, w)))
            assert pipeline == {(p - 1) * (f + b - w)}, (f, b, w, m)
    one_f_one_b, _ = idle(simulate(schedule_table("1f1b", p, 2 * p), Costs(1, 3)))  # B = the whole backward, B + W
    assert one_f_one_b == {(p - 1) * (1 + 3)}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_is_a_parallelogram_with_1f1b_memory(p):
    """ZB-V (Qi et al., section 6; the authors' table: bubble 0 and 1F1B's activation memory when
    t_F = t_B = t_W): no rank idles inside its own window once m >= 2p - 1; the windows are offset
    by one chunk forward per rank (the parallelogram, which the paper's post-validated optimizer
    step overlaps with the next iteration and labkit's global-norm step does not), so in the
    step's window each rank idles (p - 1)·t_F. Each rank holds at most 2p chunk-microbatches:
    p microbatches of a whole stage, 1F1B's first-stage peak."""
    for m in (2 * p - 1, 2 * p, 4 * p):
        sim = simulate(schedule_table("zbv", p, m, 2), Costs(1, 1, 1))
        pipeline, own = idle(sim)
        assert own == {0} and pipeline == {p - 1}, m
        assert set(sim.in_flight.values()) == {2 * p}
    assert simulate(schedule_table("zbv", p, 4 * p, 2)).bubble == pytest.approx((p - 1) / (6 * 4 * p + p - 1))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_holds_pp_plus_one_and_idles_one_forward_per_rank(p):
    """DualPipeV (DeepSeek-V3 report, section 3.2.1; deepseek-ai/DualPipe's table with PP = 2p
    stages): activation per device PP + 1 = 2p + 1 chunk-microbatches, exactly. Its bubble
    (PP/2 - 1)(F&B + B - 3W) prices each overlapped pair as F&B; run one after the other as here
    (F&B = F + B + W with unit costs) the simulator finds (p - 1)·t_F per rank, the least any
    schedule can (the last rank cannot start before p - 1 forwards upstream), within the
    table's 2(p - 1)."""
    for m in (2 * p, 3 * p, 5 * p):
        sim = simulate(schedule_table("dualpipev", p, m, 2), Costs(1, 1, 1))
        pipeline, _ = idle(sim)
        assert pipeline == {p - 1}  # under the table's (p - 1)(F&B + B - 3W) = 2(p - 1): F&B = 3, B = 2, W = 1
        assert set(sim.in_flight.values()) == {2 * p + 1}


def test_the_v_places_both_ends_on_rank_0_and_turns_on_rank_p_minus_1():
    p = 4
    assert [stage_of(r, c, p, "v") for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(rank_chunk_of(stage_of(r, c, p, "v"), p, "v") == (r, c) for r in range(p) for c in (0, 1))
    table = schedule_table("zbv", p, 8, 2)
    turn = [a for a in table.actions[p - 1] if a.op.startswith(("send", "recv"))]
    assert all(a.peer != p - 1 for a in turn)  # stage 3 -> 4 is rank 3's own: no message
    assert [list(chunk_layers(8, p, 2, 0, c, placement="v")) for c in (0, 1)] == [[0], [7]]
    cfg = ParallelConfig(pp=p, virtual_stages=2, schedule="zbv", microbatches=8)
    assert tp.stage_layers(cfg, M8, 0) == (2, True, True)  # the embedding and the head
    sends = [r for r in theory.estimate(cfg, M8).comm_table() if r["op"] == "send"]
    assert sum(r["calls"] for r in sends) == 2 * (2 * p - 2) * 8  # 2p - 1 boundaries, one of them local


def test_theory_counts_what_w_holds_and_frees_activations_at_w():
    """held_for_w: the gradients B keeps for W, walked along the schedule; 0 on the first stage
    (no input gradient: its W is the whole backward), none without a split backward."""
    cfg = ParallelConfig(pp=4, microbatches=8, schedule="zbh1")
    est = theory.estimate(cfg, M8)
    held = [m["held_for_w"] for m in est.memory]
    assert held[0] == 0 and all(h > 0 for h in held[1:])
    one_chunk = tp.held_bytes(cfg, M8, 2, head=False, embed=False)
    assert held[1] == one_chunk * max(a - b for a, b in _pending_ws(cfg, 1))
    assert "held_for_w" not in theory.estimate(cfg.replace(schedule="1f1b"), M8).memory[1]
    # a microbatch lives from its F to its W: ZB-H1 holds min(m, p) on every rank (1F1B's first-stage
    # count, Qi et al. section 2.1), 1F1B p - r on rank r
    ofob = theory.estimate(cfg.replace(schedule="1f1b"), M8)
    for r in range(4):
        one = ofob.memory[r]["activations"] // (4 - r)
        assert est.memory[r]["activations"] == 4 * one


def _pending_ws(cfg, rank):
    """(B's run, W's run) after each action of a rank: how many B's wait for their W."""
    b = w = 0
    for a in schedule_table(cfg.schedule, cfg.pp, cfg.microbatches).actions[rank]:
        b += a.op == "B"
        w += a.op == "W"
        yield b, w


def test_the_estimate_takes_the_simulated_zero_bubble():
    cfg = ParallelConfig(pp=4, microbatches=8, schedule="zbh1")
    assert theory.estimate(cfg, M8).bubble == pytest.approx(3 / (3 * 8 + 3))  # (p-1)/(3m+p-1)


def test_llama_405b_on_torchtitans_layout_is_estimated():
    """torchtitan's Llama 3.1 405B: FSDP8 x TP8 x PP8, 126 layers on 8 uneven stages. Under a
    pipeline each FSDP unit is gathered once and reduce-scattered once per step, a stage's units
    all gathered (and their gradient buffers all alive) at once over it."""
    stages = (15, 16, 16, 16, 16, 16, 16, 15)
    for schedule in ("1f1b", "zbh1"):
        cfg = ParallelConfig(
            dp=8, tp=8, pp=8, sharding="fsdp", stage_layers=stages, microbatches=16, global_batch=128,
            sequence_parallel=True, precision="bf16", schedule=schedule,
        )  # fmt: skip
        est = theory.estimate(cfg, LLAMA31_405B)
        assert est.world == 512 and 0 < est.bubble < 0.35
        units = {r["op"]: r["calls"] for r in est.rank_rows(0) if r["dim"] == "dp"}
        assert units == {"all_gather": 16, "reduce_scatter": 16}  # 15 blocks + the root, once each
        mem, padded = est.memory[0], sum(p.padded for p in sharding.flat_buffers(cfg, LLAMA31_405B))
        assert mem["gathered"] == 2 * padded  # every unit of the stage, gathered over the step (bf16)
        assert mem["reduce_buffers"] == 4 * padded  # and its gradients, unsharded, in fp32


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(pp=2, schedule="zbv", microbatches=2), "virtual_stages=2"),
        (dict(pp=2, schedule="dualpipev", virtual_stages=2, microbatches=2), r"microbatches \(2\) >= 2 \* pp"),
        (dict(pp=2, schedule="zbh1", virtual_stages=2, microbatches=2), "only applies"),
        (dict(pp=2, dp=2, schedule="zbh1", microbatches=2, impl="torch"), "DDP never sees"),
    ],
)
def test_zero_bubble_layouts_that_cannot_run_say_why(kw, words):
    with pytest.raises(ConfigError, match=words):
        validate(ParallelConfig(**kw), M8, 4)
    tied = M8.replace(arch="gpt2")
    with pytest.raises(ConfigError, match="tied embedding"):
        validate(ParallelConfig(pp=2, schedule="zbv", virtual_stages=2, microbatches=2), tied, 4)
