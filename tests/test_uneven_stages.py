"""Uneven pipeline stages (ParallelConfig.stage_layers), without a cluster: the chunk assignment, the
parameters each stage holds, and the simulator pricing each chunk by its layers."""

from __future__ import annotations

import pytest

from labkit import ParallelConfig, theory
from labkit.layout.schedules import chunk_layers, schedule_table
from labkit.layout.simulator import Costs, simulate
from labkit.theory.exact.pipeline import chunk_full_shapes, stage_scale, step_bubble
from labkit.theory.presets import LLAMA31_405B

STAGES_8 = (15, 16, 16, 16, 16, 16, 16, 15)
STAGES_16 = (7,) + (8,) * 14 + (7,)


@pytest.mark.parametrize("p, v, sizes", [(8, 1, STAGES_8), (16, 1, STAGES_16), (8, 2, STAGES_16)])
def test_126_layers_go_on_the_stages_in_order(p, v, sizes):
    held = {}
    for rank in range(p):
        for c in range(v):
            held[c * p + rank] = list(chunk_layers(126, p, v, rank, c, sizes))
    assert [len(held[s]) for s in range(p * v)] == list(sizes)
    assert [i for s in range(p * v) for i in held[s]] == list(range(126))


def test_each_stage_holds_its_own_layers_parameters():
    cfg = ParallelConfig(pp=8, stage_layers=STAGES_8, microbatches=8)
    per_stage = [sum(n.startswith("blocks.") for n, _ in chunk_full_shapes(cfg, LLAMA31_405B, r)[0]) for r in range(8)]
    assert per_stage == [9 * n for n in STAGES_8]  # 9 tensors per llama block
    total = sum(theory.exact.params.rank_param_count(cfg, LLAMA31_405B, r) for r in range(8))
    assert total == theory.num_params(LLAMA31_405B)  # untied: nothing held twice


def test_the_simulator_prices_each_chunk_by_its_layers():
    """pp=2, m=2, stages of 3 and 1 layers: forwards and backwards cost 1.5 and 0.5 (the mean is 2
    layers). 1F1B on rank 0: F0 0-1.5, F1 -3, B0 -4.5 (its gradient came back at 2.5), B1 -6; the
    step is the first stage's 6 units, the second idles 4 of them."""
    cfg = ParallelConfig(pp=2, microbatches=2, stage_layers=(3, 1))
    scale = stage_scale(cfg, 4)
    assert scale == {(0, 0): 1.5, (1, 0): 0.5}
    sim = simulate(schedule_table("1f1b", 2, 2), Costs(scale=scale))
    assert sim.busy == {0: 6.0, 1: 2.0} and sim.makespan == 6.0 and sim.per_rank[1] == pytest.approx(4 / 6)
    even = simulate(schedule_table("1f1b", 2, 2))  # the same 8 units of work, split 4 and 4: idle on both ranks
    assert even.busy == {0: 4.0, 1: 4.0} and even.makespan == 6.0


def test_the_estimate_takes_the_uneven_bubble():
    cfg = ParallelConfig(pp=8, microbatches=16, global_batch=16, stage_layers=STAGES_8)
    even_formula = theory.pipeline_bubble(8, 16)
    assert step_bubble(cfg, LLAMA31_405B) > even_formula
    assert theory.estimate(cfg, LLAMA31_405B).bubble == step_bubble(cfg, LLAMA31_405B)
    assert step_bubble(cfg.replace(stage_layers=()), LLAMA31_405B.replace(layers=128)) == even_formula
