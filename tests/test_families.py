"""Every model family under every strategy on the session's 4-engine cluster: each layout trains
like one process (labkit.oracle.checks.assert_matches: losses, gradient norms, the final parameters) and
measures what the theory predicts, to the byte (tests/theory_match.py `compare`: model states,
activations, every comm row; PyTorch's implementations: states, FSDP2's rows, activations within
10%). Families (tests/families.py): GPT-2 (biases, tanh GELU, tied head), Llama (RMSNorm, RoPE
with Llama 3.1's scaling, SwiGLU, GQA), Llama tied with one shared KV head and Qwen2's q/k/v
biases, Mixtral (SwiGLU experts, renormalised top-2). The gpt family is the rest of the suite's.
"""

from __future__ import annotations

import pytest
from families import GPT2, LLAMA, LLAMA_TIED, MIXTRAL
from theory_match import STATES, compare, references, runs

from labkit import ParallelConfig, reference, theory
from labkit.oracle.checks import assert_matches, model_error

P = ParallelConfig
GPT2_3, LLAMA_3, LLAMA_5 = GPT2.replace(layers=3), LLAMA.replace(layers=3), LLAMA.replace(layers=5)
TIED_4, MIXTRAL_3 = LLAMA_TIED.replace(layers=4), MIXTRAL.replace(layers=3)
GPT2_MOE = GPT2.replace(experts=4, top_k=2, ffn=32)
GPT2_FUSED, LLAMA_FUSED = GPT2.replace(loss="fused"), LLAMA.replace(loss="fused")
SEEDS = {
    GPT2: 0,
    GPT2_3: 0,
    GPT2_MOE: 0,
    LLAMA: 0,
    LLAMA_3: 0,
    LLAMA_5: 0,
    LLAMA_TIED: 0,
    TIED_4: 0,
    MIXTRAL: 0,
    MIXTRAL_3: 1,
    GPT2_FUSED: 0,
    LLAMA_FUSED: 0,
}
"""Seeds whose reference moves well inside 1e-5 when only the order of its sums changes
(test_seeds_are_well_conditioned; MIXTRAL_3 with seed 0 moves 4.2e-6)."""

LAYOUTS = {
    # GPT-2: tied head, biases everywhere
    "gpt2-dp4": (P(dp=4), GPT2),
    "gpt2-zero1-dp2": (P(dp=2, sharding="zero1"), GPT2),
    "gpt2-zero2-dp2": (P(dp=2, sharding="zero2"), GPT2),
    "gpt2-zero3-dp4": (P(dp=4, sharding="zero3"), GPT2),  # embedding and head: one root unit
    "gpt2-fsdp-dp2": (P(dp=2, sharding="fsdp"), GPT2),
    "gpt2-tp2": (P(tp=2), GPT2),  # biases split (colwise) or added once (rowwise); tied: vocab-parallel both ends
    "gpt2-tp2sp": (P(tp=2, sequence_parallel=True), GPT2),
    "gpt2-pp2": (P(pp=2, microbatches=2), GPT2),  # the tied embedding on both stages
    "gpt2-pp2-uneven-dp2": (P(pp=2, dp=2, microbatches=2, stage_layers=(1, 2)), GPT2_3),
    "gpt2-cp2": (P(cp=2), GPT2),
    "gpt2-ep2-moe": (P(ep=2), GPT2_MOE),
    "gpt2-pp2-bf16": (P(pp=2, microbatches=2, precision="bf16"), GPT2),
    "gpt2-dp2-torch": (P(dp=2, impl="torch"), GPT2),
    "gpt2-tp2-torch": (P(tp=2, impl="torch"), GPT2),
    "gpt2-fsdp-torch": (P(dp=2, sharding="fsdp", impl="torch"), GPT2),
    "gpt2-pp2-torch": (P(pp=2, microbatches=2, impl="torch"), GPT2),
    "gpt2-pp2-uneven-torch": (P(pp=2, microbatches=2, stage_layers=(2, 1), impl="torch"), GPT2_3),
    # Llama: GQA, RoPE (scaled), SwiGLU, RMSNorm
    "llama-dp2": (P(dp=2), LLAMA),
    "llama-zero1-dp2": (P(dp=2, sharding="zero1"), LLAMA),
    "llama-zero2-dp2": (P(dp=2, sharding="zero2"), LLAMA),
    "llama-zero3-dp2": (P(dp=2, sharding="zero3"), LLAMA),
    "llama-fsdp-dp4": (P(dp=4, sharding="fsdp"), LLAMA),
    "llama-tp2": (P(tp=2), LLAMA),  # KV heads split: one each
    "llama-tp4sp": (P(tp=4, sequence_parallel=True), LLAMA),  # tp 4 > 2 KV heads: each shared by 2 ranks
    "llama-pp2": (P(pp=2, microbatches=2), LLAMA),
    "llama-pp2-uneven-interleaved": (
        P(pp=2, virtual_stages=2, schedule="interleaved", microbatches=2, stage_layers=(2, 1, 1, 1)),
        LLAMA_5,
    ),
    "llama-cp2": (P(cp=2), LLAMA),  # RoPE at each zigzag chunk's positions, the ring carries 2 KV heads
    "llama-cp4": (P(cp=4), LLAMA),
    "llama-dp2-bf16": (P(dp=2, precision="bf16"), LLAMA),  # RMSNorm keeps fp32 whatever the compute dtype
    "llama-dp2-torch": (P(dp=2, impl="torch"), LLAMA),
    "llama-tp2-torch": (P(tp=2, impl="torch"), LLAMA),
    "llama-tp2sp-torch": (P(tp=2, sequence_parallel=True, impl="torch"), LLAMA),  # SequenceParallel RMSNorm
    "llama-fsdp-tp2-torch": (P(dp=2, tp=2, sharding="fsdp", impl="torch"), LLAMA),  # FSDP2 x DTensor, 2-D
    "llama-fsdp-torch": (P(dp=2, sharding="fsdp", impl="torch"), LLAMA),
    "llama-pp2-torch": (P(pp=2, microbatches=2, impl="torch"), LLAMA),
    # Llama tied, one KV head, q/k/v biases
    "tied-tp2": (P(tp=2), LLAMA_TIED),  # the KV head and its biases on both tp ranks, gradients summed
    "tied-pp2": (P(pp=2, microbatches=2), LLAMA_TIED),
    "tied-zero3-dp2": (P(dp=2, sharding="zero3"), LLAMA_TIED),
    # Mixtral
    "mixtral-ep2": (P(ep=2), MIXTRAL),
    "mixtral-ep2-dp2": (P(ep=2, dp=2), MIXTRAL),
    "mixtral-fsdp-dp2": (P(dp=2, sharding="fsdp"), MIXTRAL),
    "mixtral-ep2-pp2-uneven": (P(ep=2, pp=2, microbatches=2, stage_layers=(2, 1)), MIXTRAL_3),
    # the fused cross-entropy (ModelConfig.loss): the logits and the log-sum-exp kept, not fp32 log-probabilities
    "llama-dp2-fused": (P(dp=2), LLAMA_FUSED),
    "llama-dp2-fused-bf16": (P(dp=2, precision="bf16"), LLAMA_FUSED),
    "gpt2-tp2-fused": (P(tp=2), GPT2_FUSED),  # vocab-parallel, the tied head
    "gpt2-tp2sp-fused-bf16": (P(tp=2, sequence_parallel=True, precision="bf16"), GPT2_FUSED),
    "llama-pp2-fused": (P(pp=2, microbatches=2), LLAMA_FUSED),
    "llama-pp2-fused-torch": (P(pp=2, microbatches=2, impl="torch"), LLAMA_FUSED),
    # composed
    "tied-tp2sp-pp2": (P(tp=2, pp=2, microbatches=2, sequence_parallel=True), TIED_4),
    "gpt2-dp2-cp2-zero1": (P(dp=2, cp=2, sharding="zero1"), GPT2),
    "llama-tp2sp-cp2": (P(tp=2, cp=2, sequence_parallel=True), LLAMA),  # RoPE on the gathered zigzag rows
    "mixtral-tp2sp-ep2-ac": (P(tp=2, ep=2, sequence_parallel=True, checkpoint_activations=True), MIXTRAL),
    "llama-cp2-pp2-uneven-ac": (
        P(cp=2, pp=2, microbatches=2, stage_layers=(2, 1), checkpoint_activations=True),
        LLAMA_3,
    ),
}


def gap(model, seed: int) -> float:
    """How far the fp32 reference moves (model_error, what assert_matches holds to 1e-5) when only
    the order of its sums changes: its batch split into 2 and 8 shards."""
    ref = reference(model, steps=3, seed=seed).params
    return max(model_error(reference(model, steps=3, seed=seed, shards=k).params, ref) for k in (2, 8))


@pytest.mark.parametrize("model", list(SEEDS), ids=lambda m: f"{m.arch}-{m.layers}-{m.experts}-{m.tied}-{m.loss}")
def test_seeds_are_well_conditioned(model):
    assert gap(model, SEEDS[model]) < 3e-6


@pytest.fixture(scope="module")
def oracle(lab):
    import torch

    return references(SEEDS.__getitem__, threads=lab.apply(torch.get_num_threads)[0])


@pytest.fixture(scope="module")
def run(lab):
    return runs(lab, LAYOUTS, SEEDS.__getitem__)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_family_layout_trains_like_one_process_and_as_predicted(run, oracle, name):
    cfg, model = LAYOUTS[name]
    res = run(name)
    assert_matches(res, oracle(cfg, model))
    if cfg.impl == "torch" and cfg.tp > 1 and cfg.sharding == "none" and not model.tied:
        # DTensor's vocab-parallel embedding leaves a Replicate (V, h) gradient on every rank
        # (tests/test_tensor.py); a tied head's Shard(0) gradient arrives first and keeps its placement
        est = theory.estimate(cfg, model, world=4)
        extra = {"grads": 4 * model.vocab * model.hidden * (cfg.tp - 1) // cfg.tp}
        for rk in res.ranks:
            assert {k: rk.memory[k] for k in STATES} == {k: est.memory[rk.rank][k] + extra.get(k, 0) for k in STATES}
        return
    compare(res, cfg, model, world=4)


def test_shared_kv_heads_sum_their_gradients_over_their_ranks(run):
    """tp=4 over 2 KV heads: ranks {0, 1} hold KV head 0, {2, 3} head 1; per layer and microbatch
    wk's and wv's gradient slices (head_dim x h, fp32) are all-reduced over those two ranks only."""
    cfg, model = LAYOUTS["llama-tp4sp"]
    res = run("llama-tp4sp")
    hd, h = model.head_dim, model.hidden
    for rk in res.ranks:
        pairs = [c for c in rk.comm if c.step == 2 and len(c.group) == 2]
        assert len(pairs) == 2 * model.layers
        assert {(c.op, c.dim, c.payload_bytes, c.phase) for c in pairs} == {
            ("all_reduce", "tp", 4 * hd * h, "backward")
        }
        assert {tuple(c.group) for c in pairs} == {(0, 1) if rk.rank < 2 else (2, 3)}


def test_tied_embedding_stays_one_weight_across_the_pipeline(run):
    """The first and last stage each hold the tied embedding; one fp32 all-reduce of its gradient
    over the two per step keeps the copies equal (they come back as two equal pieces)."""
    cfg, model = LAYOUTS["gpt2-pp2"]
    res = run("gpt2-pp2")
    for rk in res.ranks:
        tied = [c for c in rk.comm if c.step == 2 and c.op == "all_reduce" and c.dim == "pp" and c.numel > 1]
        assert [c.payload_bytes for c in tied] == [4 * model.vocab * model.hidden]
    assert "embed.tok.weight" in res.params and "head.proj.weight" not in res.params


def test_uneven_stages_hold_their_layers(run):
    res = run("llama-pp2-uneven-interleaved")
    layers = {rk.coords["pp"]: rk.info["pipeline"]["layers"] for rk in res.ranks}
    assert layers == {0: [[0, 1], [3]], 1: [[2], [4]]}  # virtual stages 0..3: 2, 1, 1, 1 blocks
    params = {rk.coords["pp"]: rk.memory["params"] for rk in res.ranks}
    assert params[0] != params[1]
