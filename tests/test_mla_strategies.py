"""DeepSeek-V3's multi-head latent attention (arch 'deepseek_v3') under every strategy on the session's
4-engine cluster: each layout trains like one process (labkit.oracle.checks.assert_matches) and measures
what the theory predicts, to the byte (tests/theory_match.py `compare`: states, activations, every comm
row); two injected bugs the oracle must catch; a dry run of DeepSeek-V3's own attention at scale."""

from __future__ import annotations

import pytest
from mla_models import MLA, MLA_3, MLA_MOE

torch = pytest.importorskip("torch")


def _layouts():
    from labkit import ParallelConfig as P

    return {
        "dp2": (P(dp=2), MLA),
        "zero1-dp2": (P(dp=2, sharding="zero1"), MLA),
        "zero3-dp2": (P(dp=2, sharding="zero3"), MLA),
        "fsdp-dp2": (P(dp=2, sharding="fsdp"), MLA),
        "fsdp-dp2-torch": (P(dp=2, sharding="fsdp", impl="torch"), MLA),  # FSDP2 over the MLA blocks
        "pp2-torch": (P(pp=2, microbatches=2, impl="torch"), MLA),  # torch.distributed.pipelining
        "tp2": (P(tp=2), MLA),  # heads split, latents replicated (their gradients summed over tp)
        "tp4sp": (P(tp=4, sequence_parallel=True), MLA),  # one head per rank
        "pp2-uneven": (P(pp=2, microbatches=2, stage_layers=(2, 1)), MLA_3),
        "pp2-zbh1": (P(pp=2, microbatches=2, schedule="zbh1"), MLA),  # B keeps MLA's output gradients for W
        "cp2": (P(cp=2), MLA),  # the ring carries the up-projected K and V (padded to 12)
        "cp2-ulysses": (P(cp=2, cp_kind="ulysses"), MLA),
        "cp2-allgather": (P(cp=2, cp_kind="allgather"), MLA),
        "cp4-hierarchical": (P(cp=4, cp_kind="hierarchical", cp_a2a=2), MLA),  # all-to-all in pairs, ring across
        "dp2-bf16": (P(dp=2, precision="bf16"), MLA),  # the norms' fp32 copies of their latents
        "tp2-selective": (P(tp=2, checkpoint_activations="selective"), MLA),
        "tp2sp-cp2": (P(tp=2, cp=2, sequence_parallel=True), MLA),
        # MLA beside experts (labkit's Mixtral-style MoE until DeepSeek's is connected): ep over the experts
        "ep2-dp2-moe": (P(ep=2, dp=2), MLA_MOE),
        "fsdp-dp2-pp2-ac": (P(dp=2, pp=2, microbatches=2, sharding="fsdp", checkpoint_activations=True), MLA),
    }


LAYOUTS = _layouts()


def test_seed_is_well_conditioned():
    """As tests/test_families.py holds its seeds: the fp32 reference moves well inside 1e-5 (< 3e-6)
    when only the order of its sums changes (its batch in 2 and 8 shards)."""
    from test_families import gap

    assert max(gap(m, 0) for m in (MLA, MLA_3, MLA_MOE)) < 3e-6


@pytest.fixture(scope="module")
def oracle(lab):
    from theory_match import references

    return references(lambda model: 0, threads=lab.apply(torch.get_num_threads)[0])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mla_layout_trains_like_one_process_and_as_predicted(lab, oracle, name):
    from theory_match import compare

    from labkit.oracle.checks import assert_matches

    cfg, model = LAYOUTS[name]
    res = lab.run(cfg, model=model, steps=3, seed=0, return_params=True)
    assert_matches(res, oracle(cfg, model))
    compare(res, cfg, model, world=4)


# -- the checks can fail: one bug each, injected on the engines (tests/test_mutations.py's hook) -----
def latent_grads_not_summed(original):
    """layout/tensor.py local_param as engines/parallel/tensor/ reads it, with MLA's latent
    projections and norms marked replicated but not partial: their gradients left unsummed over tp."""

    def local_param(styles, name, full_shape, tp, tp_rank=0):
        shape, box, extra, replicas = original(styles, name, full_shape, tp, tp_rank)
        if styles[name.rsplit(".", 1)[0]]["style"] == "latent":
            extra = ()
        return shape, box, extra, replicas

    return local_param


def rope_at_local_positions(original):
    """engines/mla.py LatentRotary.forward at 0..s/cp-1 instead of the rank's zigzag positions."""
    import torch

    def forward(self, positions, dtype):
        return original(self, torch.arange(len(positions), device=positions.device), dtype)

    return forward


MUTATIONS = {
    "latent-grads-unsummed": (("labkit.engines.parallel.tensor", None, "local_param"), latent_grads_not_summed, "tp2"),
    "rope-local-positions": (("labkit.engines.mla", "LatentRotary", "forward"), rope_at_local_positions, "cp2"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_oracle_catches_an_mla_bug(lab, oracle, name):
    from test_mutations import mutated

    from labkit.cluster.shipping import register
    from labkit.oracle.checks import margins, mismatches

    target, make, layout = MUTATIONS[name]
    register(make)  # this module's functions travel by value
    cfg, model = LAYOUTS[layout]
    with mutated(lab, target, make):
        res = lab.run(cfg, model=model, steps=3, seed=0, return_params=True)
    found = mismatches(res, oracle(cfg, model))
    over = margins(res, oracle(cfg, model))
    print(
        f"\n{name}: caught by {sorted({m.check for m in found})}, margins "
        + ", ".join(f"{k} {v:.3g}" for k, v in over.items())
    )
    assert found


def test_dry_run_of_deepseek_v3_attention_at_scale_equals_the_theory():
    """One real step of two DeepSeek-V3 layers (h 7168, 128 heads, its latents, seq 4096, bf16) on
    fake tensors as rank 3 of tp 8 x cp 2 x dp 2 with SP: its saved bytes, states and every comm
    row equal theory.estimate's, activations to the byte (labkit/results/dryrun.py `differences`)."""
    from labkit import ParallelConfig
    from labkit.results.dryrun import dry_run
    from labkit.theory.presets import DEEPSEEK_V3_DENSE

    cfg = ParallelConfig(tp=8, cp=2, dp=2, sequence_parallel=True, precision="bf16", global_batch=2)
    assert dry_run(cfg, DEEPSEEK_V3_DENSE.replace(layers=2), rank=3).differences(activation_tolerance=0.0) == []
