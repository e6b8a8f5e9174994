"""Pairwise compositions on the session's 4-engine cluster (the 8-engine matrix is test_compose.py):
each layout trains like one process, with the global gradient norm counted once, and matches the
theory (tests/theory_match.py); then the pieces that make composition work, without a cluster.
"""

from __future__ import annotations

from math import prod

import pytest
from conftest import TINY
from theory_match import compare, references, runs

from labkit import ConfigError, ParallelConfig, validate
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import assert_matches

M4 = TINY.replace(layers=4)
MOE = TINY.replace(experts=4, top_k=2)
SEEDS = {TINY: 0, M4: 11, MOE: 0}  # well conditioned (test_compose.py, theory_match.reference_gap)
P = ParallelConfig

PAIRS = {
    "tp2sp-pp2": (P(tp=2, pp=2, microbatches=2, sequence_parallel=True), M4),
    "tp2-pp2-interleaved-ac": (
        P(tp=2, pp=2, virtual_stages=2, schedule="interleaved", microbatches=4, checkpoint_activations=True),
        M4,
    ),
    "tp2sp-cp2": (P(tp=2, cp=2, sequence_parallel=True), TINY),
    "tp2sp-cp2-ac": (P(tp=2, cp=2, sequence_parallel=True, checkpoint_activations=True), TINY),
    "cp2-pp2": (P(cp=2, pp=2, microbatches=2), M4),
    "cp2-pp2-gpipe-ac": (P(cp=2, pp=2, microbatches=4, schedule="gpipe", checkpoint_activations=True), M4),
    "ep2-pp2-moe": (P(ep=2, pp=2, microbatches=2), MOE),
    "tp2-ep2-moe": (P(tp=2, ep=2), MOE),
    "tp2sp-ep2-moe-ac": (P(tp=2, ep=2, sequence_parallel=True, checkpoint_activations=True), MOE),
    "tp2sp-dp2-moe": (P(tp=2, dp=2, sequence_parallel=True), MOE),
    "dp2-moe-ac": (P(dp=2, checkpoint_activations=True), MOE),
    "dp2-pp2-bf16": (P(dp=2, pp=2, microbatches=2, precision="bf16"), M4),
    "dp2-m2-bf16": (P(dp=2, microbatches=2, precision="bf16"), TINY),  # accumulated in fp32 (was 9.7e-2 off)
    "zero1-dp2-pp2-bf16": (P(dp=2, pp=2, microbatches=2, sharding="zero1", precision="bf16"), M4),
    "zero1-tp2-pp2": (P(tp=2, pp=2, microbatches=2, sharding="zero1"), M4),
    "zero1-cp2-pp2-bf16": (P(cp=2, pp=2, microbatches=2, sharding="zero1", precision="bf16"), M4),
    "zero1-dp2-ep2-bf16": (P(dp=2, ep=2, sharding="zero1", precision="bf16"), MOE),
    "zero1-dp2-ep2-moe": (P(dp=2, ep=2, sharding="zero1"), MOE),
    "zero1-dp2-cp2": (P(dp=2, cp=2, sharding="zero1"), TINY),
    "zero2-tp2sp-dp2": (P(tp=2, dp=2, sharding="zero2", sequence_parallel=True), TINY),
    "zero3-tp2-dp2-ac": (P(tp=2, dp=2, sharding="zero3", checkpoint_activations=True), TINY),
    "fsdp-tp2sp-dp2": (P(tp=2, dp=2, sharding="fsdp", sequence_parallel=True), TINY),
    "fsdp-ep2-dp2-moe": (P(ep=2, dp=2, sharding="fsdp"), MOE),
    "fsdp-torch-tp2sp-dp2": (P(tp=2, dp=2, sharding="fsdp", impl="torch", sequence_parallel=True), TINY),
}


@pytest.fixture(scope="module")
def oracle():
    """The fp32 reference of each model (its seed, 3 steps): the oracle of fp32 and bf16 layouts alike."""
    return references(SEEDS.__getitem__)


@pytest.fixture(scope="module")
def run(lab):
    """Each layout of PAIRS run once (3 steps, final parameters back), shared by the tests below."""
    return runs(lab, PAIRS, SEEDS.__getitem__)


@pytest.mark.parametrize("name", list(PAIRS))
def test_pair_trains_like_one_process_and_as_predicted(run, oracle, name):
    cfg, model = PAIRS[name]
    res = run(name)
    # every rank's global norm too: each parameter counted once (replicas over tp, MoE too, ep; shards)
    assert_matches(res, oracle(cfg, model))
    compare(res, cfg, model, world=4)


def test_gradients_are_reduced_over_their_groups(run):
    """tp2 x ep2 with SP and MoE: dense weights are all-reduced over ep, the sequence-parallel
    LayerNorms (and positions) over tp x ep, the experts over dp x cp — one rank, so not at all.
    Bytes per group: this rank's slices (TP halves the matrices, the router is replicated)."""
    from labkit.theory import param_shapes

    cfg, model = PAIRS["tp2sp-ep2-moe-ac"]
    res = run("tp2sp-ep2-moe-ac")
    sp = {n for n, _ in param_shapes(model) if ".ln" in n or "norm" in n or "pos" in n}
    experts = {n for n, _ in param_shapes(model) if n.endswith(("w1", "w2"))}
    halved = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "tok.weight", "proj.weight")
    numel = {n: (s[0] * s[1] // cfg.tp if n.endswith(halved) else prod(s)) for n, s in param_shapes(model)}
    want = {"ep": 4 * sum(k for n, k in numel.items() if n not in sp | experts), "tp-ep": 4 * sum(numel[n] for n in sp)}
    for rk in res.ranks:
        got = {}
        for c in rk.comm:
            if c.step == 2 and c.phase == "backward" and c.op == "all_reduce":
                got[c.dim] = got.get(c.dim, 0) + c.payload_bytes
        assert got == want


def test_sequence_parallel_pipeline_passes_its_rows(run):
    """Under SP each tp rank sends its s/tp rows of the residual stream to the next stage."""
    cfg, model = PAIRS["tp2sp-pp2"]
    res = run("tp2sp-pp2")
    b = cfg.global_batch // cfg.microbatches
    sends = [c for rk in res.ranks for c in rk.comm if c.op == "send"]
    assert sends and {c.payload_bytes for c in sends} == {4 * b * (model.seq // cfg.tp) * model.hidden}


def test_tp_group_across_hosts_warns(lab):
    """Lab.run warns when the layout puts a TP group on two hosts (hosts as the Lab sees them)."""
    real = lab.engines.hosts  # Lab.hosts reads the engine set's
    lab.engines.hosts = ["a", "a", "b", "b"]
    try:
        with pytest.warns(UserWarning, match="tensor parallelism talks after every layer"):
            lab.run(P(tp=2, dp=2, order="dp-tp-cp-ep-pp"), model=TINY, steps=1)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lab.run(P(tp=2, dp=2), model=TINY, steps=1)  # tp innermost: each group on one host
    finally:
        lab.engines.hosts = real


# -- without a cluster ------------------------------------------------------------------------
def test_axes_report_groups_and_hosts():
    lay = MeshLayout.from_sizes("dp-tp-cp-ep-pp", tp=2, dp=2, pp=2)
    hosts = ["a"] * 4 + ["b"] * 4
    axes = {a["dim"]: a for a in lay.axes(hosts)}
    assert [a["dim"] for a in lay.axes()] == ["dp", "tp", "cp", "ep", "pp"]
    assert axes["tp"]["groups"] == lay.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axes["tp"]["spans_hosts"] == [] and axes["tp"]["warning"] is None  # within a host: fine
    assert axes["pp"]["spans_hosts"] == lay.groups("pp") and axes["pp"]["warning"] is None
    wide = MeshLayout.from_sizes("dp-pp-tp-cp-ep", tp=2, dp=2, pp=2)  # tp outermost: 0 with 4
    warnings = wide.warnings(hosts)
    assert len(warnings) == 1 and "tp=2" in warnings[0] and "[0, 4]" in warnings[0] and "intra-node" in warnings[0]
    assert MeshLayout.from_sizes(tp=2).axes()[0]["spans_hosts"] == []  # no hosts: nothing spans


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(sharding="fsdp", pp=2, dp=2, microbatches=2, impl="torch"), "FSDP2 on torch.distributed.pipelining"),
        (dict(pp=2, microbatches=2, schedule="zbh1", checkpoint_activations=True), "nothing to defer"),
        (dict(tp=2, dp=2, impl="torch"), "FSDP2"),
        (dict(tp=2, pp=2, microbatches=2, impl="torch"), "not built yet"),
    ],
)
def test_refused_combinations_say_why(kw, words):
    with pytest.raises(ConfigError, match=words):
        validate(P(**kw), M4, 4)


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2, pp=2, sharding="zero1", microbatches=2),
        dict(dp=2, pp=2, sharding="zero2", microbatches=2),
        dict(dp=2, pp=2, sharding="zero3", microbatches=2, schedule="zbh1"),
        dict(dp=2, pp=2, sharding="fsdp", microbatches=2, schedule="interleaved", virtual_stages=2),
        dict(tp=2, dp=2, sharding="fsdp"),
        dict(tp=2, dp=2, sharding="fsdp", impl="torch"),
        dict(ep=2, dp=2, sharding="zero3"),
        dict(tp=2, ep=2, cp=2, pp=2, microbatches=2, sequence_parallel=True),
    ],
)
def test_compositions_are_accepted(kw):
    validate(P(**kw), MOE.replace(layers=4) if kw.get("ep") else M4, 16)


def test_buffers_are_sharded_over_their_reduce_groups():
    """ZeRO x TP+SP x EP: one flat buffer per reduce group, each sharded over that group's ranks."""
    from labkit.theory.exact import sharding

    cfg = P(tp=2, ep=2, dp=2, sharding="zero1", sequence_parallel=True)
    buffers = sharding.flat_buffers(cfg, MOE, None)
    dims = {p.dims: p.n for p in buffers}
    assert dims == {("dp", "ep", "cp"): 4, ("dp", "ep", "cp", "tp"): 8, ("dp", "cp"): 2}
    for p in buffers:
        kinds = {n.split(".")[-1] for n in p.names}
        if p.dims == ("dp", "cp"):
            assert kinds <= {"w1", "w2"}  # experts
        elif "tp" in p.dims:
            assert kinds <= {"weight", "bias"} and all(".ln" in n or "norm" in n or "pos" in n for n in p.names)


def test_checkpointed_moe_block_keeps_the_balance_loss_gradient():
    """Bug fixed here: a checkpointed block ran its MoE router without a graph, so the load-balancing
    loss reached no parameter (dp2 + MoE + checkpointing left the reference by 0.34). The router's
    gradient with checkpointing now equals the one without."""
    import torch

    from labkit.engines import data
    from labkit.engines.meters.memory import MemoryMeter
    from labkit.engines.model import build_model
    from labkit.engines.parallel.checkpoint import apply_ac

    tokens, targets = data.global_batch(0, 0, 4, MOE.seq, MOE.vocab)
    grads = []
    for ac in (False, True):
        net = build_model(MOE, 0)
        if ac:
            apply_ac(net, MemoryMeter())
        net(tokens, targets).backward()
        grads.append(net.blocks[0].mlp.router.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=0)
