"""The time model: Hockney's α-β per link level, 6Ψ·tokens compute, overlap rules."""

from __future__ import annotations

import pytest

from labkit.theory.timing import H100, Link, collective_seconds, compute_flops, spans_nodes, step_time


def test_ring_all_reduce_cost():
    link = Link(alpha=1e-5, beta=1e9)
    # 2(n-1) latency steps plus the bytes each rank sends at beta
    assert collective_seconds("all_reduce", 1.5e9, 4, link) == pytest.approx(6e-5 + 1.5)
    assert collective_seconds("all_gather", 0.75e9, 4, link) == pytest.approx(3e-5 + 0.75)
    assert collective_seconds("all_reduce", 1e9, 1, link) == 0


def test_groups_spanning_nodes_use_the_slow_link():
    assert not spans_nodes([0, 1, 2, 3], 8)
    assert spans_nodes([0, 8], 8)
    rows = [{"dim": "tp", "op": "all_reduce", "calls": 10, "wire_bytes": 10 * 1e8}]
    inside = step_time(rows, {"tp": list(range(8))}, 1e9, 1e6, 8)
    across = step_time(rows, {"tp": [0, 8, 16, 24, 32, 40, 48, 56]}, 1e9, 1e6, 8)
    steps = 2 * (8 - 1)
    assert inside.comm["tp"] == pytest.approx(10 * (steps * H100.intra.alpha + 1e8 / H100.intra.beta))
    assert across.comm["tp"] == pytest.approx(10 * (steps * H100.inter.alpha + 1e8 / H100.inter.beta))


def test_compute_and_overlap():
    assert compute_flops(7e9, 1e6) == 6 * 7e9 * 1e6
    assert compute_flops(7e9, 1e6, recompute=True) == 8 * 7e9 * 1e6
    # dp traffic that fits inside backward is hidden; tp traffic never is
    rows = [
        {"dim": "dp", "op": "all_reduce", "calls": 1, "wire_bytes": 1e6},
        {"dim": "tp", "op": "all_reduce", "calls": 1, "wire_bytes": 1e6},
    ]
    t = step_time(rows, {"dp": [0, 8], "tp": [0, 1]}, 7e9, 4e6, 16)
    assert t.exposed["dp"] == 0 and t.exposed["tp"] == t.comm["tp"] > 0
    assert t.total == pytest.approx(t.compute + t.comm["tp"])
    assert t.dominant == "compute" and 0 < t.mfu <= H100.mfu
    # a bubble stretches the compute
    assert step_time([], {}, 7e9, 4e6, 16, bubble=0.5).compute == pytest.approx(
        2 * step_time([], {}, 7e9, 4e6, 16).compute
    )


def test_estimate_step_time_names_the_dominant_dim():
    from labkit import ModelConfig, ParallelConfig, theory

    m = ModelConfig(layers=8, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=2048)
    inside = theory.estimate(ParallelConfig(dp=8, tp=8, global_batch=64), m).step_time()
    across = theory.estimate(ParallelConfig(dp=8, tp=8, global_batch=64, order="dp-tp-cp-ep-pp"), m).step_time()
    assert across.comm["tp"] > 5 * inside.comm["tp"]  # tp groups spanning nodes: the slow link
    assert across.dominant == "tp"
    moe = m.replace(experts=8, top_k=2)
    assert theory.active_params(moe) < theory.num_params(moe)
