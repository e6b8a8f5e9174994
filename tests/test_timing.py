"""The time model (pure, no cluster): α-β per link, each op on a roofline, attention's s² term,
the LM head, recomputation by mode, the bubble, and what the data-parallel traffic hides behind."""

from __future__ import annotations

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.theory.planner.hardware import H100, attention_rate
from labkit.theory.planner.ops import Op, block_ops, head_ops, model_flops_per_token
from labkit.theory.planner.overlap import collective_seconds, link_of, spans_nodes
from labkit.theory.planner.timing import Link, op_seconds, phase, step_time

M = ModelConfig(layers=8, hidden=1024, heads=16, ffn=4096, vocab=32000, seq=2048)


def test_ring_all_reduce_cost():
    link = Link(alpha=1e-5, beta=1e9)
    # 2(n-1) latency steps plus the bytes each rank sends at beta
    assert collective_seconds("all_reduce", 1.5e9, 4, link) == pytest.approx(6e-5 + 1.5)
    assert collective_seconds("all_gather", 0.75e9, 4, link) == pytest.approx(3e-5 + 0.75)
    assert collective_seconds("all_reduce", 1e9, 1, link) == 0


def test_groups_spanning_nodes_use_the_nics_they_have():
    assert not spans_nodes([0, 1, 2, 3], 8) and spans_nodes([0, 8], 8)
    cfg = ParallelConfig(dp=16, tp=8)  # tp inside a node; dp: one rank per node, stride 8
    assert link_of(cfg, ("tp",), H100) == H100.intra
    assert link_of(cfg, ("dp",), H100).beta == H100.inter.beta
    fsdp = ParallelConfig(dp=64)  # eight ranks of the group on each node: eight NICs at once
    assert link_of(fsdp, ("dp",), H100).beta == min(H100.intra.beta, 8 * H100.inter.beta)
    assert link_of(ParallelConfig(dp=8), ("dp",), H100) == H100.intra


def test_roofline():
    big = Op("mm", "matmul", flops=2 * 8192**3, bytes=2 * 3 * 8192**2)
    t, memory_bound = op_seconds(big, H100)
    assert not memory_bound and t == pytest.approx(big.flops / (H100.flops * H100.matmul_eff))
    skinny = Op("mm", "matmul", flops=2 * 8192 * 64 * 64, bytes=2 * (8192 * 64 * 2 + 64 * 64))
    t, memory_bound = op_seconds(skinny, H100)
    assert memory_bound and t == pytest.approx(skinny.bytes / (H100.hbm * H100.hbm_eff))
    fp8 = Op("mm", "fp8-matmul", flops=big.flops, bytes=big.bytes / 2)
    assert op_seconds(fp8, H100)[0] == pytest.approx(big.flops / (H100.fp8_flops * H100.fp8_matmul_eff))


def test_attention_is_quadratic_in_the_sequence_and_slower_on_short_blocks():
    def flops(model, b):
        ops = block_ops(model, 1, 1, False, b, "bf16")
        return {k: sum(o.flops for o in ops if o.kind == k) for k in ("matmul", "attention")}

    short, long_ = flops(M.replace(seq=1024), 2), flops(M, 1)  # the same tokens
    assert short["matmul"] == long_["matmul"]
    assert long_["attention"] == 2 * short["attention"] == 4 * 1 * 2048**2 * 1024 / 2  # causal: half
    assert attention_rate(H100, 128, 2048) < attention_rate(H100, 128, 8192) == H100.flops * H100.attention_eff
    assert attention_rate(H100, 64, 8192) < attention_rate(H100, 128, 8192)


def test_the_lm_head_and_the_model_flops():
    lm = [o for o in head_ops(M, 2, 1, False, 1, "bf16") if o.kind == "matmul"]
    assert [o.flops for o in lm] == [2 * M.seq * M.hidden * M.vocab // 2]  # vocab-parallel over tp=2
    blocks = 12 * M.hidden**2 + 0  # 4h² attention + 8h² MLP per block, norms left out below
    n = M.layers * (blocks + 4 * M.hidden) + 2 * M.hidden + M.vocab * M.hidden  # + norms, final norm, head
    assert model_flops_per_token(M) == 6 * n + 12 * M.layers * M.hidden * M.seq


def test_recomputation_by_mode():
    cfg = ParallelConfig(dp=8, global_batch=8, sharding="fsdp", precision="bf16")
    t = {ac: step_time(cfg.replace(checkpoint_activations=ac), M) for ac in (False, "selective", "op", True)}
    assert t[False].compute < t["selective"].compute < t["op"].compute < t[True].compute
    block = phase(block_ops(M, 1, 1, False, 1, "bf16"), H100)
    assert t["selective"].compute - t[False].compute == pytest.approx(M.layers * block.attention_forward)
    assert t[True].compute - t[False].compute == pytest.approx(M.layers * block.forward)


def test_the_bubble_stretches_the_slowest_stage():
    for m, v in ((4, 1), (8, 1), (8, 2)):
        cfg = ParallelConfig(pp=4, microbatches=m, global_batch=m, virtual_stages=v)
        cfg = cfg.replace(schedule="interleaved") if v > 1 else cfg
        t = step_time(cfg, M)
        busy = t.compute + sum(t.exposed[d] for d in ("pp",))
        assert t.bubble == pytest.approx(busy * 3 / (m * v))


def test_fsdp_gathers_hide_behind_compute_until_compute_is_short():
    deep = M.replace(layers=32, vocab=512)  # the blocks' gathers, not the root unit's (embedding, head)
    cfg = ParallelConfig(dp=8, sharding="fsdp", global_batch=64, precision="bf16")
    slow, fast = step_time(cfg, deep), step_time(cfg, deep.replace(seq=64))
    assert slow.exposed["dp"] < 0.1 * slow.comm["dp"]  # all but the first gather and the last scatter hidden
    assert fast.exposed["dp"] > 0.7 * fast.comm["dp"] and fast.dominant == "dp"
    fp8 = step_time(cfg.replace(precision="fp8"), deep.replace(seq=64))
    assert fp8.comm["dp"] < fast.comm["dp"]  # fp8 all-gathers: one byte a parameter


def test_estimate_step_time_names_the_dominant_dim():
    inside = theory.estimate(ParallelConfig(dp=8, tp=8, global_batch=64), M).step_time()
    across = theory.estimate(ParallelConfig(dp=8, tp=8, global_batch=64, order="dp-tp-cp-ep-pp"), M).step_time()
    assert across.comm["tp"] > 5 * inside.comm["tp"]  # tp groups spanning nodes: the slow link
    assert across.dominant == "tp"
    assert 0 < inside.mfu < 1
    moe = M.replace(experts=8, top_k=2)
    assert theory.active_params(moe) < theory.num_params(moe)
    assert model_flops_per_token(moe) < model_flops_per_token(moe.replace(top_k=8))
