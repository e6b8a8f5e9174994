"""GPT-OSS under the strategies built for it on the session's 4-engine cluster: each layout trains
like one process (labkit.oracle.checks.assert_matches) and measures the model states, the activations and
every comm row the theory predicts, to the byte. The tiny model keeps each feature live: a window of 6 < seq 16
on every other layer, a sink per head, biases on q/k/v/o, the router and the experts (split with them over ep),
head_dim 16 apart from hidden / heads, YaRN. What is not built (cp kinds other than the ring, DTensor's tp) is
refused at the door."""

from __future__ import annotations

import pytest
from theory_match import compare

from labkit import ConfigError, ModelConfig, ParallelConfig, reference, validate
from labkit.config.latent import YarnRope
from labkit.oracle.checks import assert_matches

P = ParallelConfig
OSS = ModelConfig(
    arch="gpt_oss", layers=2, hidden=32, heads=4, kv_heads=2, kv_channels=16, ffn=24, vocab=128, seq=16,
    experts=4, top_k=2, rope_theta=150000.0, sliding_window=6, window_pattern=2,
    yarn=YarnRope(factor=32.0, original_max_position=8, mscale=0.0, mscale_all_dim=0.0, truncate=False),
)  # fmt: skip
SEED = 0

LAYOUTS = {
    "oss-dp2": P(dp=2),
    "oss-zero3-dp2": P(dp=2, sharding="zero3"),
    "oss-fsdp-dp2": P(dp=2, sharding="fsdp"),
    "oss-pp2": P(pp=2, microbatches=2),
    "oss-dp2-bf16": P(dp=2, precision="bf16"),  # the top-k softmax's fp32 output apart from the bf16 gates
    "oss-ep2": P(ep=2),  # two experts a rank, their biases with them
    "oss-cp2": P(cp=2),  # ring on the full layer, the window exchange on the local one, a sink once per query
    "oss-cp4": P(cp=4),  # chunks of 2: a window of 6 reaches two peers back
    "oss-dp2-ep2-zero1": P(dp=2, ep=2, sharding="zero1"),  # composed
    "oss-cp2-ep2": P(cp=2, ep=2),  # composed
    "oss-tp2": P(tp=2),  # the sinks split by heads with wq's rows, o's bias added once after the sum
    "oss-tp2sp": P(tp=2, sequence_parallel=True),
    "oss-tp4sp": P(tp=4, sequence_parallel=True),  # one query head a rank, each KV head shared by two
    "oss-tp2sp-cp2": P(tp=2, cp=2, sequence_parallel=True),  # composed
    "oss-cp2-selective": P(cp=2, checkpoint_activations="selective"),  # the sinked ring rerun in backward
    "oss-pp2-ac": P(pp=2, microbatches=2, checkpoint_activations=True),
    "oss-pp2-ep2": P(pp=2, ep=2, microbatches=2),  # composed
}


@pytest.fixture(scope="module")
def oracle(lab):
    import torch

    threads = lab.apply(torch.get_num_threads)[0]
    cache = {}

    def get(cfg):
        if cfg.global_batch not in cache:
            cache[cfg.global_batch] = reference(OSS, steps=3, seed=SEED, global_batch=cfg.global_batch, threads=threads)
        return cache[cfg.global_batch]

    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process_with_the_predicted_bytes(lab, oracle, name):
    cfg = LAYOUTS[name]
    res = lab.run(cfg, model=OSS, steps=3, seed=SEED, return_params=True)
    assert_matches(res, oracle(cfg))
    compare(res, cfg, OSS, world=4)  # states, activations and every comm row, to the byte


@pytest.mark.parametrize(
    "cfg, says",
    [
        (P(tp=2, impl="torch"), "impl='torch' with tp=2 and arch='gpt_oss'"),
        (P(cp=2, cp_kind="allgather"), "cp_kind='allgather' with arch='gpt_oss'"),
    ],
)
def test_what_is_not_built_is_refused_at_the_door(cfg, says):
    with pytest.raises(ConfigError, match=says):
        validate(cfg, OSS, engines=4)


def test_the_planner_counts_a_rank_s_parameters_as_the_exact_theory():
    """labkit/theory/planner/stages.py's closed form against the exact per-rank count, for GPT-OSS's sinks
    (split over tp with the heads) and its router's bias (whole, as the router)."""
    from labkit.theory.exact.params import rank_param_count
    from labkit.theory.planner.stages import rank_params

    for tp, ep in ((1, 1), (2, 1), (2, 2)):  # tp <= kv_heads: the closed form splits wk, wv evenly
        cfg = P(tp=tp, ep=ep)
        got = rank_params(OSS, tp, ep)
        per_rank = got.embed + got.head + OSS.layers * (got.dense + got.expert)
        assert per_rank == rank_param_count(cfg, OSS, 0), (tp, ep)
