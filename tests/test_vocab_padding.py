"""A padded vocabulary (ModelConfig.vocab_divisible_by, Megatron's --make-vocab-size-divisible-by):
any vocab under any tp, and the same model as the unpadded one.

GPT-2 as published (vocab 50,257, odd) is refused under tp=2 without padding, the refusal naming the
field; with it, the embedding and the head get `padded_vocab(tp)` rows and the padding logits are
masked out of the loss. Proven three ways: in one process, rows of garbage in the padding change
neither the loss nor any real gradient, bit for bit, and the padding's own gradient is exactly zero;
on the cluster, GPT-2's widths and vocabulary train under tp=2, tp=4, tp x pp and tp + SP like the
one-process reference of the UNPADDED model (the oracle compares the vocabulary rows and holds the
padding rows at zero), and the theory prices every rank's bytes exactly; the published parameter
count stays the unpadded one, the padding reported apart.
"""

from __future__ import annotations

import html

import pytest
import torch
from theory_match import compare

from labkit import ConfigError, ModelConfig, ParallelConfig, theory
from labkit.config.validation import problems
from labkit.oracle.checks import mismatches, padding
from labkit.theory.presets import GPT2_124M, LLAMA31_405B, PUBLISHED_PARAMS

PADDED = ModelConfig(arch="gpt2", layers=2, hidden=32, heads=4, ffn=128, vocab=251, seq=16, vocab_divisible_by=8)
GPT2_SMALL = GPT2_124M.replace(layers=2, hidden=64, heads=4, ffn=256, seq=32, vocab_divisible_by=128)
"""GPT-2's published vocabulary (50,257: no tp divides it), 2 blocks 64 wide, seq 32. The padding is the
vocabulary's and the tp's; GPT-2's own width (768) only multiplied what each run ships back (its
parameters and every step's gradients for the replay): 70 s for these four runs, now a twelfth of the bytes."""


def test_padded_rows_as_megatron_computes_them():
    """Megatron core_v0.19.0 megatron/training/vocab_utils.py: ceil(vocab / (d * tp)) * d * tp."""
    gpt2 = GPT2_124M.replace(vocab_divisible_by=128)
    assert [gpt2.padded_vocab(t) for t in (1, 2, 4, 8)] == [50304, 50432, 50688, 51200]
    # Llama 3's 128,256 is 1002 x 128: no padding at tp=1, 768 rows at tp=8 (Megatron's log says the same)
    llama = LLAMA31_405B.replace(vocab_divisible_by=128)
    assert (llama.padded_vocab(1), llama.padded_vocab(8)) == (128256, 129024)
    assert GPT2_124M.padded_vocab(8) == 50257 and GPT2_124M.padded(8) is GPT2_124M  # off: nothing moves
    assert gpt2.padded(2).vocab == 50432 and gpt2.padded(2).vocab_divisible_by is None
    with pytest.raises(ConfigError, match="vocab_divisible_by=0 must be >= 1"):
        ModelConfig(vocab_divisible_by=0)


def test_tp_without_padding_is_refused_naming_the_field():
    (found,) = problems(ParallelConfig(tp=2), GPT2_124M)
    assert "vocab=50257 is not divisible by tp=2" in found and "vocab_divisible_by=128" in found and "50432" in found
    assert problems(ParallelConfig(tp=2), GPT2_124M.replace(vocab_divisible_by=128)) == []
    with pytest.raises(ConfigError, match="DTensor's loss_parallel has no mask"):
        from labkit.config.validation import validate

        validate(ParallelConfig(tp=2, impl="torch", sharding="fsdp"), GPT2_124M.replace(vocab_divisible_by=128))


def test_published_count_is_unpadded_and_the_padding_is_reported_apart():
    gpt2 = GPT2_124M.replace(vocab_divisible_by=128)
    assert theory.num_params(gpt2) == gpt2.num_params() == PUBLISHED_PARAMS["gpt2-124m"]
    est = theory.estimate(ParallelConfig(tp=4), gpt2)
    assert est.model is gpt2 and est.laid_out.vocab == 50688
    assert est.padding_params == (50688 - 50257) * 768  # tied: one table
    assert html.escape("+ 331,008 of vocabulary padding (50,257 -> 50,688 rows)") in est._repr_html_()


@pytest.mark.parametrize("loss", ["fp32", "fused"])
def test_padding_rows_never_change_the_loss(loss):
    """One process: the padded model (tp=4's rows) against the unpadded, then with garbage in the padding."""
    from labkit.engines.model import build_model

    model = PADDED.replace(loss=loss)
    ref, pad = build_model(model, 0), build_model(model, 0, tp=4)
    assert pad.embed.tok.weight.shape[0] == 256 and ref.embed.tok.weight.shape[0] == 251
    real = dict(ref.named_parameters())
    for name, p in pad.named_parameters():  # the same random stream: every real row equal, the padding zero
        assert torch.equal(p[: real[name].shape[0]], real[name]), name
    assert not pad.embed.tok.weight[251:].any()
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, 251, (2, 16), generator=g), torch.randint(0, 251, (2, 16), generator=g)
    pad(tokens, targets).backward()
    clean = {n: p.grad.clone() for n, p in pad.named_parameters()}
    loss_clean = pad(tokens, targets).item()
    assert not clean["embed.tok.weight"][251:].any()  # no gradient reaches the padding
    with torch.no_grad():
        pad.embed.tok.weight[251:] = 100 * torch.randn(5, 32, generator=g)  # garbage, large
    pad.zero_grad()
    dirty = pad(tokens, targets)
    dirty.backward()
    assert dirty.item() == loss_clean  # bit for bit: the padding logits are -inf whatever the rows hold
    for n, p in pad.named_parameters():
        assert torch.equal(p.grad, clean[n]), n
    torch.testing.assert_close(ref(tokens, targets).item(), loss_clean, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(tp=2, dp=2, global_batch=4),
        ParallelConfig(tp=4, global_batch=4),
        ParallelConfig(tp=2, pp=2, microbatches=2, global_batch=4),
        ParallelConfig(tp=2, dp=2, sequence_parallel=True, global_batch=4),
    ],
    ids=["tp2", "tp4", "tp2-pp2", "tp2-sp"],
)
def test_gpt2_as_published_trains_under_tp_like_one_process(lab, ref_cache, cfg):
    ref = ref_cache(GPT2_SMALL.replace(vocab_divisible_by=None), steps=2, global_batch=4)  # the UNPADDED model
    res = lab.run(cfg, model=GPT2_SMALL, steps=2, return_params=True)
    assert mismatches(res, ref) == []
    rows = GPT2_SMALL.padded_vocab(cfg.tp) - 50257
    h = GPT2_SMALL.hidden
    assert res.params["embed.tok.weight"].shape == (50257, h)  # the vocabulary rows, compared
    assert res.padding["params"]["embed.tok.weight"].shape == (rows, h)  # the padding, held at zero
    assert res.padding["grads"]["embed.tok.weight"].shape == (rows, h)
    compare(res, cfg, GPT2_SMALL, world=4)  # every rank's bytes and comm rows, as theory.estimate prices them


def test_the_padding_check_can_fail():
    """checks.padding names the tensor and the rows when the padding moved."""

    class Moved:
        model = PADDED
        padding = {"grads": {"embed.tok.weight": torch.zeros(5, 32).numpy()}}

    Moved.padding["grads"]["embed.tok.weight"][2, 3] = 1e-3
    (found,) = padding(Moved)
    assert found.check == "padding" and "grads embed.tok.weight: 1 element(s) of the padding rows [251:)" in str(found)
