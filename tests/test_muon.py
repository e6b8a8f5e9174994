"""Muon (OptimConfig name='muon'): torch.optim.Muon's update, bit for bit, for the blocks' matrices and AdamW for
the rest (labkit/layout/optimizer.py), executed on the layouts that hold each matrix whole or gather it (DDP,
TP + SP, PP, EP, CP, PyTorch's DDP with torch.optim.Muon), each exact against one process, its state and its
gathers the theory's to the byte; refused by name where Distributed Muon's shard gather is not built. Its
mutations are in tests/test_mutations.py."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from torch.utils.flop_counter import FlopCounterMode

from labkit import ConfigError, OptimConfig, ParallelConfig, reference, theory
from labkit.engines.muon import Optimizer, orthogonalized
from labkit.layout.optimizer import matrices, takes_muon
from labkit.oracle.checks import mismatches
from labkit.theory.exact.muon import newton_schulz_flops

MUON = OptimConfig(name="muon")
LLAMA = TINY.replace(arch="llama", kv_heads=2)
MOE = TINY.replace(experts=4, top_k=2)
STEPS = 2


def test_labkits_muon_is_torchs_bit_for_bit():
    """The same matrices, gradients and settings: labkit's update (engines/muon.py) and torch.optim.Muon give
    the same bits, a tall and a wide matrix, the 'match_rms_adamw' scaling and no Nesterov too; an expert stack
    is its matrices, each orthogonalized in a Linear's orientation."""
    torch.manual_seed(0)
    for cfg in (MUON, MUON.replace(adjust_lr="match_rms_adamw", nesterov=False, momentum=0.9)):
        for shape in ((64, 32), (32, 96)):
            ours, theirs = torch.randn(shape), None
            theirs = ours.clone().requires_grad_(True)
            opt = Optimizer([ours], [True], cfg, [("blocks.0.attn.wq.weight", shape)])
            torch_opt = torch.optim.Muon(
                [theirs],
                lr=cfg.muon_lr,
                weight_decay=cfg.muon_weight_decay,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                adjust_lr_fn=None if cfg.adjust_lr == "original" else cfg.adjust_lr,
            )
            for _ in range(3):
                g = torch.randn(shape)
                opt.step([g])
                theirs.grad = g.clone()
                torch_opt.step()
            assert torch.equal(ours, theirs.detach()), (cfg.adjust_lr, shape)
    stack = torch.randn(3, 16, 48)  # (E, in, out)
    ortho = orthogonalized(stack, 5)
    for e in range(3):
        assert torch.equal(ortho[e], orthogonalized(stack[e].T.contiguous(), 5).T)


def test_the_rule_sends_the_blocks_matrices_to_muon_and_the_rest_to_adamw():
    shapes = dict(theory.param_shapes(MOE.replace(arch="llama", kv_heads=2)))
    muon = {n for n, s in shapes.items() if takes_muon(n, s)}
    assert "blocks.0.attn.wq.weight" in muon and "blocks.1.mlp.w2" in muon  # a projection, an expert stack
    assert not muon & {"embed.tok.weight", "head.proj.weight", "blocks.0.mlp.router.weight", "blocks.0.ln1.weight"}
    assert matrices("blocks.0.mlp.w1", shapes["blocks.0.mlp.w1"]) == [(TINY.ffn, TINY.hidden)] * MOE.experts


def test_newton_schulz_flops_are_the_formula():
    """Per iteration 4A^2B + 2A^3 for an A x B matrix, A <= B (theory/exact/muon.py), counted by torch's own
    FLOP counter on the iterations (the norm and the casts are not matmuls)."""
    model = TINY.replace(layers=1)
    counted = 0
    for name, shape in theory.param_shapes(model):
        if takes_muon(name, shape):
            with FlopCounterMode(display=False) as fc:
                orthogonalized(torch.randn(shape), MUON.ns_steps)
            counted += fc.get_total_flops()
    assert counted == newton_schulz_flops(model, MUON)


LAYOUTS = [
    (ParallelConfig(dp=4), TINY),
    (ParallelConfig(dp=4, precision="bf16"), TINY),
    (ParallelConfig(tp=2, dp=2, sequence_parallel=True, precision="bf16"), LLAMA),
    (ParallelConfig(tp=4), LLAMA),
    (ParallelConfig(pp=2, dp=2, microbatches=2), TINY),
    (ParallelConfig(ep=2, dp=2), MOE),
    (ParallelConfig(cp=2, dp=2, precision="bf16"), TINY),
    (ParallelConfig(dp=4, impl="torch"), TINY),
    # Distributed Muon: each flat buffer's updates gathered whole over its shard group (engines/muon.py ShardedMuon)
    (ParallelConfig(dp=4, sharding="zero1"), TINY),
    (ParallelConfig(dp=4, sharding="zero2", precision="bf16"), TINY),
    (ParallelConfig(dp=4, sharding="zero3"), TINY),
    (ParallelConfig(dp=4, dp_replicate=2, sharding="fsdp", precision="bf16"), LLAMA),
    (ParallelConfig(dp=2, pp=2, microbatches=2, sharding="zero1"), TINY),
    (ParallelConfig(ep=2, dp=2, sharding="zero1"), MOE),
]


@pytest.mark.parametrize(
    "cfg, model",
    LAYOUTS,
    ids=[f"{c.precision}-dp{c.dp}-tp{c.tp}-pp{c.pp}-cp{c.cp}-ep{c.ep}-{c.sharding}-{c.impl}" for c, _ in LAYOUTS],
)
def test_muon_trains_like_one_process_with_the_theorys_bytes(lab, cfg, model):
    res = lab.run(cfg, model=model, steps=STEPS, optim=MUON, return_params=True)
    found = mismatches(res, reference(model, steps=STEPS, optim=MUON))
    assert found == [], [str(f) for f in found]
    est = theory.estimate(cfg, model, world=4, optim=MUON)
    # what the theory prices apart from this: an all-to-all's bytes follow the tokens' routing (the theory's
    # balanced, tests/test_experts.py); PyTorch's DDP broadcasts its rebuilt bucket order once (test_ddp.py)
    priced = lambda r: r["dim"] != "ep" and r["op"] != "broadcast"  # noqa: E731
    rows = lambda t: {(r["rank"], r["dim"], r["op"]): (r["calls"], r["payload_bytes"]) for r in t if priced(r)}  # noqa: E731
    assert rows(res.comm_table()) == rows(est.comm_table())
    for rk in res.ranks:  # one fp32 buffer a Muon parameter, Adam's two for the rest
        assert rk.memory["optimizer"] == est.memory[rk.rank]["optimizer"], rk.rank
    adamw = theory.estimate(cfg, model, world=4)
    assert est.memory[0]["optimizer"] < adamw.memory[0]["optimizer"]


@pytest.mark.parametrize(
    "cfg, model, says",
    [
        (ParallelConfig(dp=2, tp=2, sharding="zero1"), TINY, "gather of a tp slice's shards"),
        (ParallelConfig(dp=2, sharding="fsdp", impl="torch"), TINY, "FSDP2 with torch.optim.Muon"),
        (ParallelConfig(pp=2, microbatches=2, impl="torch"), TINY, "torch.optim.Muon takes plain 2-D"),
        (ParallelConfig(dp=2, impl="torch"), MOE, "refuses the experts' stacked"),
    ],
)
def test_what_muon_does_not_run_on_is_refused_by_name(lab, cfg, model, says):
    jobs = lab.jobs
    with pytest.raises(ConfigError, match=says):
        lab.run(cfg, model=model, steps=1, optim=MUON)
    assert lab.jobs == jobs  # refused at the door
