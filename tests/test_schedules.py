"""Pipeline schedules as data and their simulator (pure: no torch, no cluster)."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.layout.schedules import COMPUTE, Action, ScheduleTable, batches, local_problems, schedule_table, with_comm
from labkit.layout.simulator import Costs, ScheduleDeadlock, check, simulate, simulate_nccl
from labkit.theory.exact import pipeline as tp

PS = (2, 3, 4, 5, 8, 16, 64)
MS = (1, 2, 3, 5, 8, 13, 64, 256)


def exact_bubbles(sim) -> set[Fraction]:
    """Each rank's idle fraction as an exact fraction (integer costs give integer times)."""
    T = Fraction(sim.makespan)
    return {(T - Fraction(sim.busy[r])) / T for r in sim.busy}


def test_schedule_module_does_not_import_torch():
    code = (
        "import sys, labkit.layout.schedules, labkit.layout.simulator, labkit.theory;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bubble_is_the_formula_exactly(schedule):
    """GPipe and 1F1B idle (p-1)/(m+p-1) of the step on every rank, for unit costs, p <= 64, m <= 256."""
    for p in PS:
        for m in MS:
            sim = simulate(schedule_table(schedule, p, m))
            assert not sim.problems
            assert exact_bubbles(sim) == {Fraction(p - 1, m + p - 1)}, (schedule, p, m)
            assert sim.bubble == pytest.approx(theory.pipeline_bubble(p, m), abs=1e-12)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_the_formula_exactly(v):
    """Megatron's interleaved 1F1B idles (p-1)/(v·m+p-1), for m a multiple of p up to 256."""
    for p in (2, 3, 4, 8, 64):
        for m in sorted({p, 3 * p, 256 - 256 % p}):
            sim = simulate(schedule_table("interleaved", p, m, v))
            assert not sim.problems
            assert exact_bubbles(sim) == {Fraction(p - 1, v * m + p - 1)}, (p, m, v)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_bubble_formula_holds_when_backward_costs_twice_forward(schedule, v):
    """The formula needs t_F and t_B equal on every stage, not equal to each other."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            sim = simulate(schedule_table(schedule, p, m, v), Costs(F=1.0, B=2.0))
            assert exact_bubbles(sim) == {Fraction(p - 1, v * m + p - 1)}


def test_zero_bubble_h1_takes_3m_plus_p_minus_1():
    """ZB-H1 with t_F = t_B = t_W: the step is 3m + p - 1 long (bubble (p-1)(t_F+t_B-t_W),
    Qi et al. table 2) against 1F1B's 3m + 3(p - 1), with 1F1B's peak memory (min(m, p))."""
    for p in (2, 4, 8, 16):
        for m in (p, 2 * p, 5 * p):
            zb = simulate(schedule_table("zbh1", p, m), Costs(1, 1, 1))
            split_1f1b = 3 * m + 3 * (p - 1)
            assert zb.makespan == 3 * m + p - 1 < split_1f1b
            assert max(zb.in_flight.values()) == min(m, p)


@pytest.mark.parametrize(
    "schedule, v",
    [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zbh1", 1), ("zbv", 2), ("dualpipev", 2)],
)
def test_every_generated_schedule_passes_its_own_check(schedule, v):
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 3 * p + 2):
            if (schedule == "interleaved" and m % p) or (schedule == "dualpipev" and m < 2 * p):
                continue
            table = schedule_table(schedule, p, m, v)
            assert check(table) == [], (schedule, p, m, v)
            n_compute = (3 if schedule in ("zbh1", "zbv", "dualpipev") else 2) * m * v
            assert all(len(table.compute(r)) == n_compute for r in range(p))


def test_memory_in_flight_gpipe_m_1f1b_p_minus_rank():
    for p in (2, 4, 8):
        for m in (1, 3, p, 2 * p + 1):
            g, o = simulate(schedule_table("gpipe", p, m)), simulate(schedule_table("1f1b", p, m))
            for r in range(p):
                assert g.in_flight[r] == tp.in_flight("gpipe", p, m, r) == m
                assert o.in_flight[r] == tp.in_flight("1f1b", p, m, r) == min(m, p - r)


def broken_schedule() -> ScheduleTable:
    """Rank 0 runs F0 B0 F1 B1 (waits for microbatch 0's gradient before sending microbatch 1),
    rank 1 runs GPipe (sends gradient 0 only after its forward of microbatch 1): each list is
    fine on its own, together they wait on each other."""
    rank0 = with_comm([("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)], 2, 1, 0)
    rank1 = schedule_table("gpipe", 2, 2).actions[1]
    return ScheduleTable("broken", 2, 2, 1, (tuple(rank0), rank1))


def test_a_broken_schedule_is_reported_as_a_deadlock_and_not_run():
    table = broken_schedule()
    assert local_problems(table) == []  # each rank's list is valid on its own
    sim = simulate(table)
    assert sim.deadlock
    assert any("rank 0 stuck" in p and "recv_grad0" in p for p in sim.problems)
    assert any("rank 1 stuck" in p and "recv_act1" in p for p in sim.problems)
    from labkit.engines.parallel.pipeline import PipelineExecutor

    with pytest.raises(ScheduleDeadlock, match="rank 0 stuck"):
        PipelineExecutor(table, mesh=None, hidden=8)  # refused before it touches a process group


def test_local_mistakes_and_unmatched_messages_are_reported():
    good = schedule_table("1f1b", 2, 2)
    r1 = [a for a in good.actions[1] if not (a.op == "send_grad" and a.mb == 1)]
    assert any(
        "never received" in p or "stuck" in p for p in check(ScheduleTable("x", 2, 2, 1, (good.actions[0], tuple(r1))))
    )
    r0 = list(good.actions[0])
    r0[0], r0[1] = r0[1], r0[0]  # send before the forward that produces it
    assert any("comes before ['F']" in p for p in check(ScheduleTable("x", 2, 2, 1, (tuple(r0), good.actions[1]))))


def test_rendezvous_sends_deadlock_1f1b_but_not_gpipe():
    """Why the executor posts sends asynchronously: with blocking sends, 1F1B's steady state has
    neighbours sending to each other at once (activation down, gradient up)."""
    assert simulate(schedule_table("1f1b", 4, 8), blocking_sends=True).deadlock
    assert not simulate(schedule_table("gpipe", 4, 8), blocking_sends=True).deadlock
    assert not simulate(schedule_table("1f1b", 4, 8)).deadlock


def test_communication_latency_lengthens_the_step():
    p, m = 4, 8
    free = simulate(schedule_table("1f1b", p, m))
    slow = simulate(schedule_table("1f1b", p, m), Costs(comm=0.5))
    assert slow.makespan > free.makespan and slow.bubble > free.bubble
    sends = [e for e in slow.events if e["kind"] == "send"]
    assert len(sends) == 2 * (p - 1) * m and all(e["end"] - e["start"] == 0.5 for e in sends)


def test_schedule_table_round_trips_as_plain_data():
    table = schedule_table("interleaved", 2, 4, 2)
    assert ScheduleTable.from_dict(table.to_dict()) == table
    assert str(Action("send_act", 3, 1, 0)) == "send_act3.1->r0"


# -- theory from the same lists ---------------------------------------------------------------
M = ModelConfig(layers=8, hidden=32, heads=4, ffn=128, vocab=128, seq=16)


def test_stage_parameters_add_up_to_the_model():
    for pp, v, sched in [(2, 1, "1f1b"), (4, 1, "gpipe"), (2, 2, "interleaved"), (4, 2, "interleaved")]:
        cfg = ParallelConfig(pp=pp, virtual_stages=v, schedule=sched, microbatches=4)
        assert sum(tp.full_param_count(cfg, M, r) for r in range(pp)) == theory.num_params(M)
        est = theory.estimate(cfg, M)
        assert [m["params"] for m in est.memory] == [4 * tp.full_param_count(cfg, M, r) for r in range(pp)]


def test_first_stage_activations_gpipe_is_m_over_p_times_1f1b():
    p, m = 4, 8
    g = theory.estimate(ParallelConfig(pp=p, microbatches=m, schedule="gpipe"), M).memory[0]["activations"]
    o = theory.estimate(ParallelConfig(pp=p, microbatches=m, schedule="1f1b"), M).memory[0]["activations"]
    assert g == o * m // p


def test_p2p_bytes_per_microbatch_per_boundary_times_v():
    """Every microbatch crosses each of the p·v - 1 boundaries twice (activation, gradient)."""
    m, gb = 4, 8
    b = M.seq * M.hidden * 4 * gb // m  # bytes of one microbatch's (b, s, h) fp32
    for pp, v in [(2, 1), (4, 1), (2, 2), (4, 2)]:
        cfg = ParallelConfig(
            pp=pp, virtual_stages=v, microbatches=m, global_batch=gb, schedule="interleaved" if v > 1 else "1f1b"
        )
        rows = theory.estimate(cfg, M).comm_table()
        sends = [r for r in rows if r["op"] == "send"]
        assert sum(r["wire_bytes"] for r in sends) == 2 * (pp * v - 1) * m * b
        assert all(r["dim"] == "pp" for r in rows if r["op"] in ("send", "recv"))
        norm = [r for r in rows if r["op"] == "all_reduce"]
        assert len(norm) == pp and all(r["payload_bytes"] == 4 and r["dim"] == "pp" for r in norm)


def test_simulated_timeline_figure():
    from labkit.widgets.figures import simulated_timeline_figure

    p, m = 4, 6
    sim = tp.simulated(ParallelConfig(pp=p, microbatches=m, schedule="1f1b", global_batch=12))
    fig = simulated_timeline_figure(sim)
    compute = [b for b in fig.data if b.name.startswith("mb ")]
    assert len(compute) == 2 * p * m
    assert sorted({b.y[0] for b in compute}) == [f"rank {r}" for r in range(p)]
    assert f"bubble {theory.pipeline_bubble(p, m):.0%}" in fig.layout.title.text
    assert {b.marker.pattern.shape for b in compute if b.text.startswith("B")} == {"/"}
    stuck = simulated_timeline_figure(simulate(broken_schedule()))
    assert "deadlock" in stuck.layout.title.text and "rank 0 stuck" in stuck.layout.annotations[0].text


def test_measured_bubble_means_what_the_formula_means():
    """RunResult.bubble_fraction on a timeline laid out exactly as the ideal schedule gives the
    formula, also when the two data-parallel replicas' pipelines run at different times (the
    window is per pipeline, not the union over replicas)."""
    from labkit.results.run import Event, RankReport, RunResult

    p, m, dp = 4, 8, 2
    cfg = ParallelConfig(pp=p, dp=dp, microbatches=m, schedule="1f1b", global_batch=16)
    sim = tp.simulated(cfg)
    ranks = []
    for pp_rank in range(p):
        for d in range(dp):
            offset = 100.0 * d  # replica 1 starts much later
            tl = [
                Event(e["kind"], e["microbatch"], e["chunk"], e["start"] + offset, e["end"] + offset)
                for e in sim.events
                if e["rank"] == pp_rank
            ]
            ranks.append(
                RankReport(
                    pp_rank * dp + d, {"tp": 0, "cp": 0, "ep": 0, "dp": d, "pp": pp_rank}, "h", "cpu", {}, [], tl, [0.0]
                )
            )
    res = RunResult(cfg, M, 1, 0, [0.0], ranks)
    got = res.bubble_fraction()
    assert got["overall"] == pytest.approx(theory.pipeline_bubble(p, m), abs=1e-12)
    assert all(f == pytest.approx(theory.pipeline_bubble(p, m), abs=1e-12) for f in got["per_rank"].values())


# -- NCCL's rules (layout/simulator.py: simulate_nccl) -------------------------------------------
def every_schedule():
    """Every schedule labkit runs: GPipe, 1F1B, interleaved (v = 2..4), ZB-H1, ZB-V, DualPipeV (m >= 2p);
    p <= 8, m <= 16."""
    orders = (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3, 4)), ("zbh1", (1,)), ("zbv", (2,)))
    for schedule, vs in orders + (("dualpipev", (2,)),):
        for v in vs:
            for p in range(1, 9):
                for m in range(1, 17):
                    if (schedule != "interleaved" or m % p == 0) and (schedule != "dualpipev" or m >= 2 * p):
                        yield schedule_table(schedule, p, m, v)


def unbatched(table: ScheduleTable) -> tuple[list, ...]:
    """Each send and receive alone, in the schedule's order: what isend / irecv one by one would issue."""
    return tuple([a if a.op in COMPUTE else (a,) for a in acts] for acts in table.actions)


def neighbour_batches(table: ScheduleTable) -> tuple[list, ...]:
    """Each run of sends and receives between two computes as one batch (Megatron's 1F1B
    send_forward_recv_backward, but per rank, without lining batches up across ranks)."""
    out = []
    for acts in table.actions:
        items = []
        for a in acts:
            if a.op in COMPUTE:
                items.append(a)
            elif items and not isinstance(items[-1], Action):
                items[-1] = (*items[-1], a)
            else:
                items.append((a,))
        out.append(items)
    return tuple(out)


def test_every_plan_completes_under_nccl_as_the_executor_issues_it():
    """The executor's batches (schedules.batches) meet only their peers' batches of the same tick:
    every schedule completes under NCCL's rules, as fast as under gloo's with unit costs, and the
    executor's check (both rules) accepts it."""
    count = 0
    for table in every_schedule():
        nccl, gloo = simulate_nccl(table), simulate(table)
        assert nccl.problems == [] == check(table), (table.schedule, table.p, table.m, table.v, nccl.problems[:2])
        assert nccl.makespan == gloo.makespan and nccl.in_flight == gloo.in_flight, (table.schedule, table.p, table.m)
        count += 1
    dualpipev = sum(max(0, 17 - 2 * p) for p in range(1, 9))
    assert count == 4 * 8 * 16 + 3 * sum(16 // p for p in range(1, 9)) + dualpipev  # 702 schedules


def test_batches_keep_the_plans_computes_and_issue_each_message_once():
    for table in every_schedule():
        for r, items in enumerate(batches(table)):
            assert [a for a in items if isinstance(a, Action)] == table.compute(r)
            p2p = [a for it in items if not isinstance(it, Action) for a in it]
            assert sorted(p2p) == sorted(a for a in table.actions[r] if a.op not in COMPUTE)
            assert all(it for it in items)  # no empty batch is posted


def test_unbatched_sends_deadlock_1f1b_under_nccl_but_not_gpipe():
    """The review's replay: with one queue per communicator and rendezvous sends, 1F1B p=2 m=2
    hangs at its first steady step (rank 0 in send_act1->r1, rank 1 in send_grad0->r0)."""
    sim = simulate_nccl(schedule_table("1f1b", 2, 2), issued=unbatched(schedule_table("1f1b", 2, 2)))
    assert sim.deadlock
    assert any("rank 0 stuck" in p and "send_act1->r1" in p for p in sim.problems)
    assert any("rank 1 stuck" in p and "send_grad0->r0" in p for p in sim.problems)
    for p in (2, 4, 8):
        for m in (p, 2 * p):
            assert simulate_nccl(schedule_table("1f1b", p, m), issued=unbatched(schedule_table("1f1b", p, m))).deadlock
            assert not simulate_nccl(
                schedule_table("gpipe", p, m), issued=unbatched(schedule_table("gpipe", p, m))
            ).deadlock
            assert not simulate(schedule_table("1f1b", p, m)).deadlock  # gloo's buffered sends hide it


def test_batching_only_neighbouring_sends_and_receives_still_hangs_interleaved():
    """Why the executor lines batches up by tick: 1F1B completes with per-rank neighbour batches,
    interleaved 1F1B does not once it has a steady state (m >= 2p; its forward ring is cyclic)."""
    for p in (2, 4):
        for m in (2 * p, 3 * p):
            assert not simulate_nccl(
                schedule_table("1f1b", p, m), issued=neighbour_batches(schedule_table("1f1b", p, m))
            ).deadlock
            table = schedule_table("interleaved", p, m, 2)
            assert simulate_nccl(table, issued=neighbour_batches(table)).deadlock


def test_nccl_ignores_tags_so_messages_out_of_order_are_refused():
    """Rank 1 runs F1 before F0: under gloo the tags sort it out; NCCL would hand it microbatch 0's
    activation as microbatch 1's. Issued one by one, the schedule is refused; the executor's batches
    post receives in the senders' order, so they are not."""
    rank0 = with_comm([("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)], 2, 1, 0)
    rank1 = with_comm([("F", 1, 0), ("F", 0, 0), ("B", 0, 0), ("B", 1, 0)], 2, 1, 1)
    table = ScheduleTable("swapped", 2, 2, 1, (tuple(rank0), tuple(rank1)))
    assert local_problems(table) == [] and not simulate(table).problems
    found = simulate_nccl(table, issued=unbatched(table)).problems
    assert any("NCCL ignores tags" in p and "send_act0->r1" in p and "recv_act1<-r0" in p for p in found)
    assert simulate_nccl(table).problems == []
