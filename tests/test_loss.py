"""The two cross-entropies (ModelConfig.loss, engines/loss.py), no cluster: the fused one gives
F.cross_entropy's loss and gradient, in fp32 and in bf16, whole or a chunk of rows at a time,
and keeps the logits and the fp32 log-sum-exp for backward instead of fp32 log-probabilities."""

from __future__ import annotations

import pytest
import torch

import labkit.engines.loss as loss_module
from labkit import ConfigError, ModelConfig, ParallelConfig, theory
from labkit.config.validation import problems
from labkit.engines.loss import cross_entropy


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps (nll_loss keeps log_softmax's output again,
    one storage; the saved-tensor meter counts it once too)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("chunk", [None, 64], ids=["whole", "chunked"])
def test_the_fused_loss_is_the_fp32_loss(dtype, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(loss_module, "LOSS_CHUNK", chunk)  # 2 rows of 32 logits at a time
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 32, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 32, (3, 5))
    want = cross_entropy(logits, targets, "fp32")
    (g_want,) = torch.autograd.grad(want, logits)
    got = cross_entropy(logits, targets, "fused")
    (g_got,) = torch.autograd.grad(got, logits)
    assert got.dtype == torch.float32 and g_got.dtype == dtype
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    # bf16: both round the same fp32 gradient to bf16 once
    assert torch.allclose(g_got.float(), g_want.float(), rtol=1e-6, atol=1e-8)


def test_the_fused_loss_keeps_the_logits_and_the_log_sum_exp():
    n, v = 15, 32
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    fp32 = _saved_bytes(lambda: cross_entropy(logits[None], targets[None], "fp32"))
    fused = _saved_bytes(lambda: cross_entropy(logits[None], targets[None], "fused"))
    assert fp32 == 4 * n * v + 8 * n + 4  # log_softmax's fp32 output, nll's targets and total weight
    assert fused == 2 * n * v + 4 * n + 8 * n  # the bf16 logits, the fp32 log-sum-exp, the targets


def test_the_theory_prices_the_fused_loss_and_validation_names_the_choices():
    model = ModelConfig(arch="llama", layers=4, hidden=1024, heads=8, ffn=2048, vocab=128256, seq=4096)
    cfg = ParallelConfig(dp=8, global_batch=16, sharding="fsdp", precision="bf16")
    fp32, fused = (theory.evaluate(cfg, model.replace(loss=how), "h100").memory for how in ("fp32", "fused"))
    logits = 2 * 4096 * 128256
    assert fp32["activations"] - fused["activations"] == 2 * logits + 4 - 4 * 2 * 4096
    assert fp32["logits"] == 8 * logits and fused["logits"] == 2 * logits + 4 * 2**24
    with pytest.raises(ConfigError, match="loss='fast' is not one of"):
        theory.evaluate(cfg, model.replace(loss="fast"))
    refused = problems(ParallelConfig(tp=2, impl="torch"), model.replace(loss="fused"))
    assert any("DTensor's loss_parallel" in p for p in refused), refused
