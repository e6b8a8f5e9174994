"""Qwen3, SmolLM3 and Gemma 3 under every strategy on the session's 4-engine cluster: each
layout trains like one process (labkit.oracle.checks.assert_matches) and measures the model states,
the activations and every comm row the theory predicts, to the byte — Gemma 3's sliding-window layers under context
parallelism included, where only the K/V rows inside the window travel (labkit/layout/window.py).
The tiny models keep each feature live: Qwen3's q/k norms and head_dim apart from hidden / heads
(16 on h 32 with 4 heads), SmolLM3's NoPE layers (every 2nd here), Gemma 3's windows (7 < seq 32,
a global layer every 3rd, its own RoPE bases, the linear factor, query_pre_attn_scalar != head_dim)."""

from __future__ import annotations

import pytest
from theory_match import compare, references, runs

from labkit import ConfigError, ModelConfig, ParallelConfig, reference, theory, validate
from labkit.layout.window import window_rows
from labkit.oracle.checks import assert_matches, model_error

P = ParallelConfig
QWEN3 = ModelConfig(
    arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, kv_channels=16, ffn=64, vocab=128, seq=16,
    rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
)  # fmt: skip
SMOL = ModelConfig(
    arch="llama", layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16, rope_theta=5e6,
    norm_eps=1e-6, tie_embeddings=True, nope_interval=2,
)  # fmt: skip
GEMMA = ModelConfig(
    arch="gemma3", layers=3, hidden=32, heads=4, kv_heads=2, kv_channels=16, ffn=64, vocab=128, seq=32,
    rope_theta=1e6, rope_local_theta=1e4, rope_linear_factor=8.0, norm_eps=1e-6, qk_norm=True,
    sliding_window=7, window_pattern=3, query_pre_attn_scalar=12.0,
)  # fmt: skip

SEEDS = {QWEN3: 0, SMOL: 0, GEMMA: 2}
"""Seeds whose reference moves well inside the oracle's 1e-5 when only the order of its sums changes
(test_seeds_are_well_conditioned). Gemma with seeds 0 and 1 moves 6.6e-6 to 1.3e-5 under cp 2, cp 4
and tp 2 x cp 2 (measured), with seeds 2 and 3 3.2e-7 to 5.9e-7: the seed, not the layout."""

LAYOUTS = {
    "qwen3-dp2": (P(dp=2), QWEN3),
    "qwen3-zero3-dp2": (P(dp=2, sharding="zero3"), QWEN3),
    "qwen3-tp2": (P(tp=2), QWEN3),  # q_norm / k_norm whole on each rank, gradients summed over tp
    "qwen3-tp4sp": (P(tp=4, sequence_parallel=True), QWEN3),  # 2 KV heads shared by 2 ranks each
    "qwen3-pp2": (P(pp=2, microbatches=2), QWEN3),
    "qwen3-cp2": (P(cp=2), QWEN3),
    "smol-fsdp-dp2": (P(dp=2, sharding="fsdp"), SMOL),
    "smol-tp2sp": (P(tp=2, sequence_parallel=True), SMOL),
    "smol-pp2": (P(pp=2, microbatches=2), SMOL),  # the tied embedding on both stages
    "smol-pp2-nope-stage": (P(pp=2, microbatches=2, stage_layers=(3, 1)), SMOL),  # stage 1: a NoPE layer, no tables
    "smol-cp4": (P(cp=4), SMOL),  # NoPE layers: no rotation at the zigzag positions either
    "gemma-dp2": (P(dp=2), GEMMA),
    "gemma-zero3-dp2": (P(dp=2, sharding="zero3"), GEMMA),
    "gemma-tp2sp": (P(tp=2, sequence_parallel=True), GEMMA),  # the scaled embedding vocab-parallel, four norms
    "gemma-pp2-uneven": (P(pp=2, microbatches=2, stage_layers=(2, 1)), GEMMA),  # local tables only on stage 0
    "gemma-cp2": (P(cp=2), GEMMA),  # chunks of 8: each local layer sends a 6-row tail
    "gemma-cp4": (P(cp=4), GEMMA),  # chunks of 4: a whole chunk and 2 rows of the one before
    "gemma-cp2-allgather": (P(cp=2, cp_kind="allgather"), GEMMA),
    "gemma-cp2-ulysses": (P(cp=2, cp_kind="ulysses"), GEMMA),
    # recomputed: the window exchange runs again in backward (selective: the attention core only)
    "gemma-cp2-selective": (P(cp=2, checkpoint_activations="selective"), GEMMA),
    "gemma-cp2-ac": (P(cp=2, checkpoint_activations=True), GEMMA),
    "qwen3-tp2sp-ac": (P(tp=2, sequence_parallel=True, checkpoint_activations=True), QWEN3),
    "smol-pp2-ac": (P(pp=2, microbatches=2, stage_layers=(3, 1), checkpoint_activations=True), SMOL),
    # bf16: the q/k norms in fp32 whatever the compute dtype (Gemma 3's one-process bf16 run is itself 4.3%
    # from the fp32 reference here, past the oracle's bf16 bound of 2%: not a layout's doing, left out)
    "qwen3-tp2sp-bf16": (P(tp=2, sequence_parallel=True, precision="bf16"), QWEN3),
    # composed
    "gemma-tp2sp-cp2": (P(tp=2, cp=2, sequence_parallel=True), GEMMA),
    "gemma-cp2-pp2-uneven": (P(cp=2, pp=2, microbatches=2, stage_layers=(2, 1)), GEMMA),  # per (stage, cp rank)
    "qwen3-tp2-pp2": (P(tp=2, pp=2, microbatches=2), QWEN3),
    "smol-dp2-cp2-zero1": (P(dp=2, cp=2, sharding="zero1"), SMOL),
}


@pytest.fixture(scope="module")
def oracle(lab):
    import torch

    return references(SEEDS.__getitem__, threads=lab.apply(torch.get_num_threads)[0])


@pytest.fixture(scope="module")
def run(lab):
    return runs(lab, LAYOUTS, SEEDS.__getitem__)


@pytest.mark.parametrize("model", list(SEEDS), ids=lambda m: m.arch + str(m.layers))
def test_seeds_are_well_conditioned(model):
    ref = reference(model, steps=3, seed=SEEDS[model]).params
    gap = max(model_error(reference(model, steps=3, seed=SEEDS[model], shards=k).params, ref) for k in (2, 8))
    assert gap < 3e-6


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process_with_the_predicted_bytes(run, oracle, name):
    cfg, model = LAYOUTS[name]
    res = run(name)
    assert_matches(res, oracle(cfg, model))
    compare(res, cfg, model, world=4)  # states, activations and every comm row, to the byte


def test_the_oracle_sees_the_window(run):
    """The check can fail: the cp run of the windowed model is not the reference of the same model
    without its window (nor of a window one row wider)."""
    res = run("gemma-cp2")
    for other in (
        GEMMA.replace(sliding_window=None, window_pattern=0, rope_local_theta=None),
        GEMMA.replace(sliding_window=8),
    ):
        with pytest.raises(AssertionError, match="does not train like the reference"):
            assert_matches(res, reference(other, steps=3, seed=SEEDS[GEMMA]))


def test_window_exchange_sends_only_the_rows_inside_the_window(run):
    """gemma-cp2 (chunks of 8, window 7): per local layer and step, each rank sends one tail of 6 K/V
    rows forward and receives the gradients of its own 6 back — measured, as the plan says; the
    global layer's ring sends its whole K/V block per hop."""
    assert window_rows(32, 2, 7, 0) == window_rows(32, 2, 7, 1) == (6, 6)
    cfg, model = LAYOUTS["gemma-cp2"]
    res = run("gemma-cp2")
    b = cfg.global_batch  # one microbatch, no dp
    row = 4 * 2 * b * model.n_kv_heads * model.head_dim  # fp32 K and V of one position
    ring = row * model.seq // cfg.cp  # the global layer's K/V block (and its fp32 dK/dV)
    sends = [c.payload_bytes for c in res.ranks[0].comm if c.op == "send" and c.dim == "cp" and c.step == 2]
    local_layers = sum(model.layer_window(i) is not None for i in range(model.layers))
    assert sorted(sends) == [6 * row] * 2 * local_layers + [ring] * 3  # the ring: K/V fwd, bwd, dK/dV


def test_theory_cp_bytes_are_limited_by_the_window():
    """Gemma 3 27B at 131,072 tokens on cp 8: a local layer (window 1024) sends 2 x 1023 rows of K/V
    each forward; the ring sends 7 hops of 16,384 rows. The planner's estimate prices exactly that."""
    from labkit.theory.presets import GEMMA3_27B

    cfg = P(cp=8, global_batch=8, dp=1)
    full = GEMMA3_27B.replace(sliding_window=None, window_pattern=0, rope_local_theta=None)
    sent = lambda m: sum(
        r["payload_bytes"]
        for r in theory.estimate(cfg, m, world=8).comm_table()
        if r["op"] == "send" and r["rank"] == 3
    )  # noqa: E731
    assert window_rows(131072, 8, 1024, 3) == (2 * 1023, 2 * 1023)
    local = sum(GEMMA3_27B.layer_window(i) is not None for i in range(62))
    assert local == 52  # five of every six of the 62 layers, the 6th, 12th, ... global
    ratio = sent(GEMMA3_27B) / sent(full)
    # 10 global layers keep the ring's bytes; 52 local ones send 2 * 2046 rows for the ring's 3 * 7 * 16384
    expect = (10 * 3 * 7 * 16384 + 52 * 2 * 2 * 1023) / (62 * 3 * 7 * 16384)
    assert ratio == pytest.approx(expect, rel=1e-12)


def test_what_is_not_built_is_refused_by_name():
    found = validate_problems(P(cp=4, cp_kind="hierarchical", cp_a2a=2), GEMMA)
    assert any("cp_kind='hierarchical' with sliding-window layers" in p for p in found)
    found = validate_problems(P(tp=2, impl="torch"), QWEN3)
    assert any("impl='torch' with tp > 1 on a model with qk_norm" in p for p in found)
    assert not validate_problems(P(cp=4, cp_kind="hierarchical", cp_a2a=2), GEMMA.replace(seq=64, sliding_window=64))


def validate_problems(cfg, model) -> list[str]:
    try:
        validate(cfg, model, 4)
    except ConfigError as e:
        return e.problems
    return []


def test_planner_prices_the_window():
    """The time model (theory/planner/timing.py, ops.py) on Gemma 3 27B at 65,536 tokens, tp 8 x cp 8:
    the local layers' attention computes s·w - w(w-1)/2 pairs of s²/2 and their cp traffic is the
    window exchange's, so the step is shorter than the same model with every layer global; the
    exchange's seconds are the slowest rank's messages (labkit/layout/window.py)."""
    from labkit.theory.planner.timing import step_time
    from labkit.theory.presets import GEMMA3_27B

    gemma = GEMMA3_27B.replace(seq=65536)
    every_global = gemma.replace(sliding_window=None, window_pattern=0, rope_local_theta=None)
    cfg = P(cp=8, tp=8, sequence_parallel=True, global_batch=8, precision="bf16")
    local, full = step_time(cfg, gemma, world=64), step_time(cfg, every_global, world=64)
    assert local.compute < full.compute and local.comm["cp"] < full.comm["cp"] / 3
    assert local.total < full.total
    # MFU's model FLOPs (PaLM's convention) count a local layer's queries against w keys, not s
    from labkit.theory.planner.ops import model_flops_per_token

    q = gemma.heads * gemma.head_dim  # the same parameters: the difference is the 52 local layers' keys
    drop = model_flops_per_token(every_global) - model_flops_per_token(gemma)
    assert drop == pytest.approx(12.0 * q * 52 * (65536 - 1024), rel=1e-12)
