"""Compiled blocks (ParallelConfig.compile): each block's forward through torch.compile
(engines/parallel/compile.py), on one process against eager and on the 4-engine cluster against
the one-process reference, with the model states and every collective equal to the theory's (the
hooks and collectives stay outside the graphs or run eagerly between them). The compiled graphs
save other tensors than eager: measured here, not held to the eager theory.

Compiling on two CPU cores is slow (inductor writes and builds C++): the cluster cases are marked
slow and share one small model; the engines keep their compile cache between runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from labkit import ParallelConfig, theory
from labkit.engines.model import build_model
from labkit.engines.parallel.compile import apply_compile
from labkit.oracle.checks import assert_matches

GQA = TINY.replace(arch="llama", kv_heads=2)


def _saved_elements(model, tokens, targets) -> tuple[torch.Tensor, int]:
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), sum(saved)


def test_a_compiled_block_computes_what_eager_does():
    eager, compiled = build_model(GQA, 0), apply_compile(build_model(GQA, 0))[0]
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, GQA.vocab, (2, GQA.seq), generator=gen) for _ in range(2))
    want, eager_saved = _saved_elements(eager, tokens, targets)
    got, compiled_saved = _saved_elements(compiled, tokens, targets)
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-5, atol=1e-7), name
    # the memory meter's hooks see the compiled function's saves, which are not eager's
    assert 0 < compiled_saved < eager_saved, (compiled_saved, eager_saved)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def _graphs_compiled() -> int:
    import torch._dynamo

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


CASES = [
    (ParallelConfig(dp=2, tp=2, sequence_parallel=True, sharding="fsdp", compile=True), TINY),
    (ParallelConfig(dp=2, pp=2, sharding="zero1", microbatches=2, compile=True), GQA),
    (ParallelConfig(dp=2, cp=2, sharding="zero3", checkpoint_activations=True, compile=True), GQA),
    (ParallelConfig(dp=4, sharding="fsdp", impl="torch", precision="bf16", compile=True), TINY),
]


@pytest.mark.slow
@pytest.mark.parametrize("cfg, model", CASES, ids=["fsdp-tp-sp", "zero1-pp", "zero3-cp-ac", "fsdp2-bf16"])
def test_compiled_layouts_train_like_one_process(lab, ref_cache, cfg, model):
    res = lab.run(cfg, model=model, steps=3, return_params=True)
    assert_matches(res, ref_cache(model, steps=3, global_batch=cfg.global_batch))  # bf16: its bounds
    assert all(rk.info["compile"]["blocks"] > 0 for rk in res.ranks)  # every rank compiled its blocks
    assert min(lab.apply(_graphs_compiled, timeout=60)) >= 1  # every engine compiled (its cache outlives runs)
    est = theory.estimate(cfg, model, world=4)
    states = ("params", "grads", "optimizer")
    for rk in res.ranks:
        assert {k: rk.memory[k] for k in states} == {k: est.memory[rk.rank][k] for k in states}, rk.rank
        assert rk.memory["activations"] > 0
    if not cfg.torch_impl:
        assert res.comm_table() == est.comm_table()
    else:
        keep = ("rank", "dim", "op", "calls", "payload_bytes", "wire_bytes")
        assert [{k: r[k] for k in keep} for r in res.comm_table()] == [
            {k: r[k] for k in keep} for r in est.comm_table()
        ]
