"""Selective activation checkpointing (Korthikanti et al. 2022, section 4.2: the attention core
recomputed) on the cluster: the run equals the one-process reference, and what it keeps for
backward and sends equals the theory to the byte."""

from __future__ import annotations

import pytest
from conftest import TINY
from test_sharding import check_against_theory, oracle  # noqa: F401  (oracle is a fixture)

from labkit import ParallelConfig, theory
from labkit.oracle.checks import assert_matches


@pytest.mark.parametrize("kw", [dict(dp=2, tp=2), dict(dp=2, cp=2)])
def test_selective_recomputes_the_attention_core(lab, oracle, kw):  # noqa: F811
    """Each block drops only its attention's log-sum-exp (fp32, b x heads/tp x s/cp), which the
    recomputation rebuilds; under CP the ring runs again in backward (one more K/V round per
    layer), which the comm rows show."""
    cfg = ParallelConfig(checkpoint_activations="selective", global_batch=8, **kw)
    res = lab.run(cfg, model=TINY, steps=3, return_params=True)
    assert_matches(res, oracle(cfg))
    check_against_theory(res, cfg, TINY)  # activations, states and every comm row, exactly
    plain = theory.estimate(cfg.replace(checkpoint_activations=False), TINY).memory[0]["activations"]
    b = cfg.global_batch // cfg.dp
    lse = 4 * b * (TINY.heads // cfg.tp) * (TINY.seq // cfg.cp)
    for rk in res.ranks:
        assert plain - rk.memory["activations"] == TINY.layers * lse
