"""Mixed precision (bf16 compute, fp32 masters) and activation checkpointing on the cluster, and
the theory of sharding (no cluster): the ZeRO paper's bytes and volumes, refusals."""

from __future__ import annotations

import pytest
from conftest import TINY
from test_sharding import ODD, check_against_theory, oracle  # noqa: F401  (oracle is a fixture)

from labkit import ConfigError, ParallelConfig, theory, validate
from labkit.layout.flat import padded, unit_layouts
from labkit.oracle.checks import assert_matches
from labkit.theory.exact import sharding

PSI = theory.num_params(TINY)


def test_bf16_ddp_holds_2_2_12_bytes_per_parameter(lab, oracle):  # noqa: F811
    cfg = ParallelConfig(dp=4, precision="bf16")
    res = lab.run(cfg, model=TINY, steps=3, return_params=True)
    assert_matches(res, oracle(cfg))
    paper = theory.model_state_bytes(PSI, 4, "bf16")["none"]
    for rk in res.ranks:
        assert [rk.memory[k] for k in ("params", "grads", "optimizer")] == [
            paper["params"],
            paper["grads"],
            paper["optimizer"],
        ]
    check_against_theory(res, cfg, TINY)


@pytest.mark.parametrize(
    "kw", [dict(), dict(sharding="zero3", precision="bf16"), dict(impl="torch"), dict(sharding="fsdp", impl="torch")]
)
def test_checkpointing_drops_activations_by_the_predicted_factor(lab, oracle, kw):  # noqa: F811
    """Each block keeps only its input; backward recomputes one block at a time."""
    cfg = ParallelConfig(dp=4, checkpoint_activations=True, **kw)
    res = lab.run(cfg, model=TINY, steps=3, return_params=True)
    assert_matches(res, oracle(cfg))
    plain = theory.estimate(cfg.replace(checkpoint_activations=False), TINY).memory[0]["activations"]
    predicted = theory.estimate(cfg, TINY).memory[0]["activations"]
    assert predicted < plain
    for rk in res.ranks:
        assert plain / rk.memory["activations"] == pytest.approx(plain / predicted, rel=1e-12)
    if cfg.impl == "lab":
        check_against_theory(res, cfg, TINY)


# -- theory only ------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_states_are_the_papers_plus_padding(stage, precision):
    """ZeRO paper, figure 1, on ODD at N = 4: the lab's bytes exceed the formula by the padding only,
    at most N - 1 elements per flat buffer."""
    n = 4
    cfg = ParallelConfig(dp=n, sharding=stage, precision=precision)
    exact = sharding.state_bytes(cfg, ODD, n)
    paper = theory.model_state_bytes(theory.num_params(ODD), n, precision)[stage]
    buffers = len(sharding.flat_buffers(cfg, ODD, n))
    per_element = 16  # 2 + 2 + 12 or 4 + 4 + 8
    extra = sum(exact.values()) - paper["total"]
    assert 0 < extra <= buffers * (n - 1) * per_element


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("n", [2, 4])
def test_traffic_in_elements_of_psi(n, precision):
    """Per rank per step, ring model: DDP 2Ψ(N-1)/N; ZeRO-1/2 and FSDP without resharding
    2Ψ(N-1)/N; ZeRO-3 and FSDP 3Ψ(N-1)/N (Ψ counted with padding; gradients travel in fp32,
    parameters in the compute dtype; the norm's one scalar left out)."""
    elem = {"fp32": 4, "bf16": 2}[precision]
    for cfg, volume in [
        (ParallelConfig(dp=n, precision=precision), 2),
        (ParallelConfig(dp=n, sharding="zero1", precision=precision), 2),
        (ParallelConfig(dp=n, sharding="zero2", precision=precision), 2),
        (ParallelConfig(dp=n, sharding="zero3", precision=precision), 3),
        (ParallelConfig(dp=n, sharding="fsdp", precision=precision), 3),
        (ParallelConfig(dp=n, sharding="fsdp", reshard_after_forward=False, precision=precision), 2),
    ]:
        psi = (
            sum(p.padded for p in sharding.flat_buffers(cfg, ODD, n))
            if cfg.sharding != "none"
            else theory.num_params(ODD)
        )
        rows = [r for r in theory.estimate(cfg, ODD).comm_table() if r["rank"] == 0 and r["payload_bytes"] > 4]
        elements = sum(r["wire_bytes"] / (4 if r["op"] != "all_gather" else elem) for r in rows)
        assert elements == pytest.approx(volume * psi * (n - 1) / n), cfg


def test_units_and_padding_rule():
    layouts = unit_layouts([(n, s) for n, s in theory.param_shapes(ODD)], 4, "zero3")
    assert [p.unit for p in layouts] == ["embed", "blocks.0", "blocks.1", "head"]
    for p in layouts:
        assert p.padded == padded(p.numel, 4) and p.padded % 4 == 0 and p.padded - p.numel < 4
        assert sum(p.real(i) for i in range(4)) == p.numel  # padding belongs to no one
        assert [d for _, _, d in p.runs(0)][:1] == [True]  # matrices first: decayed
    fsdp = unit_layouts([(n, s) for n, s in theory.param_shapes(ODD)], 4, "fsdp")
    assert [p.unit for p in fsdp] == ["", "blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    "kw, fix",
    [
        (dict(sharding="zero1", impl="torch"), "impl='lab'"),
        (dict(sharding="zero2", impl="torch"), "reshard_after_forward=False"),
        (dict(sharding="zero3", impl="torch"), "sharding='fsdp'"),
        (dict(precision="bf16", impl="torch"), "impl='lab'"),
        (dict(sharding="zero3", reshard_after_forward=False), "sharding='fsdp'"),
    ],
)
def test_combinations_without_an_implementation_are_refused(kw, fix):
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig(dp=4, **kw), TINY, 4)
    assert fix in str(err.value)


def test_reference_shards_change_nothing_in_fp32():
    from labkit import reference
    from labkit.oracle.checks import param_errors

    whole, split = reference(TINY, steps=2), reference(TINY, steps=2, shards=4)
    assert max(param_errors(split.params, whole.params).values()) < 1e-5
    assert split.losses == pytest.approx(whole.losses, rel=1e-6)
