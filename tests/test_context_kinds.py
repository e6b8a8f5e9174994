"""Context parallelism's kinds: K/V all-gathered and Ulysses' all-to-all, each alone
against dense causal attention and composed on the 4-engine cluster against the one-process
reference, with measured bytes and memory against the theory."""

from __future__ import annotations

import pytest
import theory_match
from conftest import TINY

from labkit import ConfigError, ParallelConfig, theory, validate
from labkit.oracle.checks import assert_matches

GQA = TINY.replace(arch="llama", kv_heads=2)
"""Grouped-query attention: 4 query heads read 2 KV heads."""
GPT2 = TINY.replace(arch="gpt2")
"""GPT-2's family: biases, tied embedding (across the pipeline's stages), its tanh GELU."""

# (cp, seq, batch, heads, kv heads, head_dim): odd shapes on purpose (chunks of 3 and 5 tokens)
KERNEL_CASES = [(2, 12, 2, 4, 2, 4), (2, 20, 1, 2, 2, 8), (4, 24, 2, 4, 4, 5), (4, 40, 1, 8, 2, 3)]


def _kinds_against_dense(cases):
    """On every rank: random q, k, v (float64, the same on all ranks); dense causal attention on the
    whole sequence against each cp kind on this rank's zigzag tokens; per case and kind the largest
    relative error of the output and of dq, dk, dv at this rank's positions."""
    import torch
    import torch.nn.functional as F

    from labkit.engines import runtime
    from labkit.engines.mesh import Mesh
    from labkit.engines.parallel.context import zigzag_index
    from labkit.engines.parallel.context.kinds import Gathered, Hierarchical, Ulysses
    from labkit.layout.mesh import MeshLayout

    rank = runtime.current().rank
    errors = {}
    for cp, seq, b, nh, nkv, hd in cases:
        mesh = Mesh.build(MeshLayout.from_sizes(cp=cp, dp=4 // cp), rank)
        r, group = mesh.coord("cp"), mesh.group("cp")
        gen = torch.Generator().manual_seed(1000 * cp + seq)
        q, w = (torch.randn(b, nh, seq, hd, generator=gen, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, nkv, seq, hd, generator=gen, dtype=torch.float64) for _ in range(2))
        dense = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True)
        (out * w).sum().backward()
        idx = zigzag_index(seq, cp, r)
        want = [out[:, :, idx]] + [t.grad[:, :, idx] for t in dense]
        kinds = {"allgather": Gathered(group, r, cp)}
        if nkv % cp == 0:
            kinds["ulysses"] = Ulysses(group, r, cp, seq)
        if cp == 4:  # all-to-all over runs of 2, the ring across the 2 runs
            kinds["hierarchical"] = Hierarchical(mesh.run_group("cp", 2), mesh.stride_group("cp", 2), cp, 2, r)
        for name, core in kinds.items():
            local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
            y = core(*local)
            (y * w[:, :, idx]).sum().backward()
            got = [y.detach()] + [t.grad for t in local]
            errors[cp, seq, name] = max(float((g - x).abs().max() / x.abs().max()) for g, x in zip(got, want))
    return errors


def test_every_kind_matches_dense_causal_attention(lab):
    per_rank = lab.apply(_kinds_against_dense, KERNEL_CASES)
    for rank, errors in enumerate(per_rank):
        # every case has all-gather; Ulysses where the KV heads divide by cp; hierarchical at cp = 4
        assert len(errors) == 9
        for key, err in errors.items():
            assert err < 1e-12, (rank, key, err)


LAYOUTS = [
    (ParallelConfig(cp=2, dp=2, cp_kind="allgather"), TINY),
    (ParallelConfig(cp=4, cp_kind="allgather"), GQA),
    (ParallelConfig(cp=4, cp_kind="ulysses"), TINY),
    (ParallelConfig(cp=2, tp=2, sequence_parallel=True, cp_kind="ulysses"), TINY),
    (ParallelConfig(cp=2, dp=2, cp_kind="ulysses", precision="bf16"), GQA),
    (ParallelConfig(cp=2, pp=2, microbatches=2, cp_kind="allgather", checkpoint_activations=True), TINY),
    (ParallelConfig(cp=2, dp=2, cp_kind="ulysses", checkpoint_activations="selective"), TINY),
    (ParallelConfig(cp=2, dp=2, cp_kind="ulysses", checkpoint_activations="full"), GQA),
    (ParallelConfig(cp=2, ep=2, cp_kind="allgather"), GPT2.replace(experts=4, top_k=2)),
    (ParallelConfig(cp=2, pp=2, microbatches=2, cp_kind="ulysses"), GPT2),
    (ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2), GQA),
    (
        ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2, precision="bf16", checkpoint_activations="selective"),
        TINY,
    ),
]


@pytest.mark.parametrize(
    "cfg,model",
    LAYOUTS,
    ids=[
        "allgather-cp2xdp2",
        "allgather-cp4-gqa",
        "ulysses-cp4",
        "ulysses-cp2xtp2-sp",
        "ulysses-bf16-gqa",
        "allgather-pp-ac",
        "ulysses-selective",
        "ulysses-full-gqa",
        "allgather-cp2xep2-gpt2-moe",
        "ulysses-cp2xpp2-gpt2",
        "hierarchical-gqa",
        "hierarchical-bf16-selective",
    ],
)
def test_context_kinds_train_like_one_process(lab, ref_cache, cfg, model):
    """Losses, gradients and parameters match the fp32 reference; comm rows equal the theory's
    (calls included); model states and activations equal it exactly."""
    res = lab.run(cfg, model=model, steps=3, return_params=True)
    assert_matches(res, ref_cache(model=model))
    est = theory.estimate(cfg, model, world=4)
    if model.experts:  # the experts' all-to-alls and activations follow the routing: theory_match reads it
        theory_match.compare(res, cfg, model, world=4)
        return
    assert res.comm_table() == est.comm_table()
    ops = {r["op"] for r in res.comm_table() if r["dim"] == "cp"} - {"all_reduce"}  # the gradients' (cp is a data dim)
    kind = cfg.context
    want = (
        {"all_gather", "reduce_scatter"}
        if kind.gathers
        else {"all_to_all"} | ({"send", "recv"} if kind.ring else set())
    )
    assert ops == want
    for rk in res.ranks:
        for k in ("params", "grads", "optimizer", "activations"):
            assert rk.memory[k] == est.memory[rk.rank][k], (rk.rank, k, rk.memory[k], est.memory[rk.rank][k])


def test_ulysses_refuses_heads_that_do_not_divide():
    with pytest.raises(ConfigError, match="splits the KV heads over cp"):
        validate(ParallelConfig(cp=4, cp_kind="ulysses"), GQA, 4)
    with pytest.raises(ConfigError, match="splits the heads over cp"):
        validate(ParallelConfig(cp=2, tp=4, cp_kind="ulysses"), TINY.replace(heads=4), 8)
    with pytest.raises(ConfigError, match="applies with cp > 1"):
        validate(ParallelConfig(dp=2, cp_kind="allgather"), TINY, 4)


# -- the planner: every kind searched, each priced from the exact theory's calls and bytes -----------
@pytest.mark.parametrize("kind", ["allgather", "ulysses", "hierarchical"])
def test_the_time_model_prices_the_exact_theorys_collectives(kind):
    """The planner's seconds for a collective kind equal Hockney's α·steps + bytes/β summed over the
    calls and bytes theory.estimate counts for the cp dim (its gradient all-reduce aside; the
    hierarchical kind's ring hops are priced with the ring's, hidden behind attention)."""
    from labkit.theory.planner.hardware import hardware_of
    from labkit.theory.planner.overlap import collective_seconds, link_of
    from labkit.theory.planner.timing import _context_collectives

    model = GQA.replace(layers=3, seq=32, heads=8, kv_heads=4, hidden=64)
    a2a = 2 if kind == "hierarchical" else 1
    cfg = ParallelConfig(
        cp=4, dp=2, global_batch=4, microbatches=2, cp_kind=kind, cp_a2a=a2a, checkpoint_activations="selective"
    )
    hw = hardware_of("h100")
    link = link_of(cfg, ("cp",), hw)
    rows = [r for r in theory.estimate(cfg, model).comm_table() if r["rank"] == 0 and r["dim"] == "cp"]
    # 8 GPUs, one node: the all-to-all's runs and the whole cp group share NVLink
    n = a2a if kind == "hierarchical" else cfg.cp
    exact = sum(
        r["calls"] * collective_seconds(r["op"], r["wire_bytes"] / r["calls"], n, link)
        for r in rows
        if r["op"] not in ("all_reduce", "send", "recv")
    )
    b = cfg.global_batch // (cfg.dp * cfg.microbatches)
    priced = model.layers * cfg.microbatches * _context_collectives(cfg, model, hw, b, recomputes=True)
    assert exact > 0 and priced == pytest.approx(exact, rel=1e-12)


def test_the_planner_searches_every_kind():
    from labkit.theory.presets import PRESETS

    model = PRESETS["llama3.1-8b"]
    kinds = {p.config.cp_kind for p in theory.plan(model, 8, "h100", top=50, fixed={"cp": 2, "tp": 1})}
    assert kinds == {"ring", "ulysses"}  # the all-gather is dominated by the ring: searched only when held
    gathered = theory.plan(model, 8, "h100", top=3, fixed={"cp": 2, "tp": 1, "cp_kind": "allgather"})
    ring = theory.plan(model, 8, "h100", top=1, fixed={"cp": 2, "tp": 1, "cp_kind": "ring"})
    assert gathered and gathered[0].tokens_per_second_per_gpu <= ring[0].tokens_per_second_per_gpu
    held = theory.plan(model, 8, "h100", top=5, fixed={"cp": 4, "cp_kind": "ulysses"})
    assert held and {(p.config.cp, p.config.cp_kind) for p in held} == {(4, "ulysses")}
    # hierarchical: each proper divisor of cp as the all-to-all's size
    runs = theory.plan(model, 8, "h100", top=50, fixed={"cp": 8, "tp": 1, "cp_kind": "hierarchical"})
    assert {p.config.cp_a2a for p in runs} == {2, 4}
    # 8 KV heads: Ulysses cannot split them over cp=16, and says so
    none = theory.plan(model, 16, "h100", fixed={"cp": 16, "cp_kind": "ulysses"})
    assert not none and any("splits the KV heads over cp" in why for why in none.counts), none.counts
