"""Mixture of experts and expert parallelism: the MoE layer on one process (against the dense MLP,
the theory's parameter list and activation bytes, the balance loss under any split), and ep
layouts on the 4-engine cluster against the reference, with measured bytes against the theory."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from labkit import ConfigError, ModelConfig, ParallelConfig, reference, theory, validate
from labkit.engines import data
from labkit.engines.meters.memory import MemoryMeter
from labkit.engines.model import build_model
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import assert_matches, loss_errors
from labkit.theory.exact.experts import layer_activation_bytes

MOE2 = TINY.replace(experts=4, top_k=2)
MOE1 = TINY.replace(experts=4, top_k=1)


ODD = ModelConfig(layers=1, hidden=48, heads=3, ffn=64, vocab=64, seq=8, experts=3, top_k=3)


@pytest.mark.parametrize("m", [MOE2, ODD])
def test_moe_parameters_and_activations_match_the_theory(m):
    check_parameters_and_activations(m)


def check_parameters_and_activations(m) -> None:
    """One process: the parameter list and count, and the bytes a forward saves, equal the theory's."""
    net = build_model(m, 0)
    assert [(n, tuple(p.shape)) for n, p in net.named_parameters()] == list(theory.param_shapes(m))
    assert sum(p.numel() for p in net.parameters()) == theory.num_params(m) == m.num_params()
    tokens, targets = data.global_batch(0, 0, 3, m.seq, m.vocab)
    meter = MemoryMeter()
    meter.exclude(net.parameters())
    with meter.saved_tensors():
        loss = net(tokens, targets)
    assert meter.live["activations"] == theory.activation_bytes(m, 3)
    loss.backward()
    del loss
    assert meter.live["activations"] == 0  # released with the graph


def test_one_expert_is_the_dense_mlp():
    """With E = 1 the router's softmax is 1, so the layer is a GELU MLP with w1 = fc1^T, w2 = fc2^T,
    and each layer's balance loss is exactly E * f * P = 1: the loss is the dense one + layers * coef."""
    moe_cfg = TINY.replace(experts=1, top_k=1)
    moe, dense = build_model(moe_cfg, 0), build_model(TINY, 0)
    with torch.no_grad():
        shared = dict(moe.named_parameters())
        for name, p in dense.named_parameters():
            if name in shared:
                p.copy_(shared[name])
        for bm, bd in zip(moe.blocks, dense.blocks):
            bd.mlp.fc1.weight.copy_(bm.mlp.w1[0].T)
            bd.mlp.fc2.weight.copy_(bm.mlp.w2[0].T)
    tokens, targets = data.global_batch(0, 0, 4, TINY.seq, TINY.vocab)
    a, b = moe(tokens, targets), dense(tokens, targets)
    torch.testing.assert_close(a, b + TINY.layers * moe_cfg.aux_loss_coef, rtol=1e-6, atol=0)
    a.backward()
    b.backward()
    torch.testing.assert_close(moe.blocks[1].mlp.w1.grad[0], dense.blocks[1].mlp.fc1.weight.grad.T)
    torch.testing.assert_close(moe.blocks[0].attn.wq.weight.grad, dense.blocks[0].attn.wq.weight.grad)


def test_moe_is_its_own_training():
    """The MoE reference is a different model from the dense one (the check below has teeth)."""
    assert abs(reference(MOE2, steps=1).losses[0] - reference(TINY, steps=1).losses[0]) > 1e-4


def test_balance_loss_is_the_same_for_any_split_of_the_batch():
    """Per-sequence statistics: the mean over any split of the batch is the whole batch's value."""
    layer = build_model(MOE2, 0).blocks[0].mlp
    x = torch.randn(8, MOE2.seq, MOE2.hidden, generator=torch.Generator().manual_seed(0))
    layer(x)
    whole = layer.aux_loss
    for parts in (2, 4, 8):
        shares = []
        for chunk in x.chunk(parts):
            layer(chunk)
            shares.append(layer.aux_loss)
        torch.testing.assert_close(torch.stack(shares).mean(), whole, rtol=1e-6, atol=0)
    assert whole > 1.0  # >= 1, with equality only for a uniform router


def test_torch_expert_parallel_is_refused():
    with pytest.raises(ConfigError, match="no expert-parallel API"):
        validate(ParallelConfig(ep=2, dp=2, impl="torch"), MOE2, 4)


def received_rows(rank_report, layers: int, hidden: int) -> list[int]:
    """R per MoE layer in the last step: rows the rank's experts received, read off the forward
    combine all-to-all (per layer: the counts, the dispatch, then the combine)."""
    fwd = [c for c in rank_report.comm if c.op == "all_to_all" and c.phase == "forward" and c.step == 2]
    assert len(fwd) == 3 * layers
    return [fwd[3 * i + 2].payload_bytes // (4 * hidden) for i in range(layers)]


CASES = [
    (ParallelConfig(ep=2, dp=2), MOE2),
    (ParallelConfig(ep=4), MOE1),
    (ParallelConfig(cp=2, ep=2), MOE2),
    (ParallelConfig(dp=4), MOE2),
]


@pytest.mark.parametrize("cfg, model", CASES, ids=["ep2xdp2-top2", "ep4-top1", "cp2xep2-top2", "dp4-moe"])
def test_expert_parallel_trains_like_one_process(lab, ref_cache, cfg, model):
    """Losses and parameters match the reference. Every comm row but the all-to-alls equals the
    theory's; the all-to-alls match in calls, per ep group in bytes, and per rank once the
    rank's routing (R, read off its combine all-to-all) replaces the balanced R = N.
    Activations: the same, exact."""
    res = lab.run(cfg, model=model, steps=3, return_params=True)
    ref = ref_cache(model)
    assert_matches(res, ref)
    for rk in res.ranks:  # the clip is inactive here (norm < 1): check the norm itself
        assert max(loss_errors(rk.grad_norms, ref.grad_norms)) < 1e-5
    est = theory.estimate(cfg, model, world=4)
    a2a = lambda rows: {r["rank"]: r for r in rows if r["op"] == "all_to_all"}
    others = lambda rows: [r for r in rows if r["op"] != "all_to_all"]
    assert others(res.comm_table()) == others(est.comm_table())  # DDP per reduce group, norm, ring
    measured, predicted = a2a(res.comm_table()), a2a(est.comm_table())
    assert sorted(measured) == sorted(predicted) == (list(range(4)) if cfg.ep > 1 else [])
    b, s = cfg.global_batch // (cfg.dp * cfg.ep), model.seq // cfg.cp
    n = b * s * model.top_k  # rows each rank sends
    h, f = model.hidden, model.ffn
    for rk in res.ranks:
        want = est.memory[rk.rank]
        for k in ("params", "grads", "optimizer"):
            assert rk.memory[k] == want[k], (rk.rank, k)
        r = received_rows(rk, model.layers, h) if cfg.ep > 1 else [n] * model.layers
        routed = sum(layer_activation_bytes(model, b, s, received=x) - layer_activation_bytes(model, b, s) for x in r)
        assert rk.memory["activations"] == want["activations"] + routed
        if cfg.ep > 1:
            got, row = measured[rk.rank], predicted[rk.rank]
            assert (got["dim"], got["calls"]) == (row["dim"], row["calls"])
            # R rows back in the forward combine and again in the dispatch's backward
            assert got["payload_bytes"] == row["payload_bytes"] + sum(2 * 4 * h * (x - n) for x in r)
    for group in MeshLayout.of(cfg).groups("ep") if cfg.ep > 1 else []:  # an ep group's totals: exact
        for key in ("payload_bytes", "wire_bytes"):
            assert sum(measured[i][key] for i in group) == sum(predicted[i][key] for i in group)
    experts = model.layers * 2 * model.experts * h * f  # w1 and w2 of every layer
    assert res.ranks[0].memory["params"] == 4 * (theory.num_params(model) - experts + experts // cfg.ep)
