"""Real text: the corpus and its byte tokenizer, deterministic batches that never read the
validation split, the validation loss of a run against the reference's, and sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from labkit import ConfigError, ModelConfig, ParallelConfig, RunResult, reference
from labkit.engines import data
from labkit.layout import text
from labkit.oracle.bounds import FP32
from labkit.oracle.checks import assert_matches
from labkit.oracle.held import replayed

TEXT = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=256, seq=16)
"""conftest's TINY with one id per byte."""


def test_the_corpus_loads_and_round_trips_through_the_tokenizer():
    raw = text.corpus()
    assert 1_000_000 < len(raw) <= 2 * 2**20 and raw.dtype == np.uint8
    assert raw.max() < 128  # plain ASCII: every byte is one character
    s = text.decode(raw)
    assert s.startswith("A MIDSUMMER NIGHT'S DREAM") and s.rstrip().endswith("THE END")
    assert text.encode(s) == raw.tolist()
    for sample in ("ROMEO.\nBut soft!", "café — ✓", ""):
        ids = text.encode(sample)
        assert all(0 <= i < text.VOCAB for i in ids) and text.decode(ids) == sample
    assert text.decode([0x66, 0xFF, 0x6F]) == "f\ufffdo"  # not UTF-8: replaced, never raised


def test_unigram_entropy_is_that_of_the_byte_counts():
    counts = np.bincount(text.corpus(), minlength=256)
    p = counts / counts.sum()
    direct = -sum(q * math.log(q) for q in p if q > 0)
    assert text.unigram_entropy() == pytest.approx(direct, rel=1e-12)
    assert 3.0 < text.unigram_entropy() < math.log(int((counts > 0).sum()))  # below uniform over the bytes used


@pytest.mark.parametrize("seq", [16, 64, 255])
def test_batches_are_deterministic_and_never_read_the_validation_split(seq):
    split = text.split()
    assert 0.05 <= 1 - split / len(text.corpus()) < 0.1 + 1e-6  # the last 10% held out
    for seed in range(5):
        for step in range(40):
            offsets = text.train_offsets(step, seed, 16, seq)
            assert offsets.min() >= 0 and offsets.max() + seq + 1 <= split, (seed, step)  # window [o, o + seq + 1)
            assert np.array_equal(offsets, text.train_offsets(step, seed, 16, seq))
        assert not np.array_equal(text.train_offsets(0, seed, 16, seq), text.train_offsets(1, seed, 16, seq))
    assert not np.array_equal(text.train_offsets(0, 0, 16, seq), text.train_offsets(0, 1, 16, seq))
    val = text.validation_offsets(seq, 8)
    assert len(val) == 64 and val.min() >= split and val.max() + seq + 1 <= len(text.corpus())
    assert len(text.validation_offsets(seq, 12)) == 72  # whole global batches
    model = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=256, seq=seq)
    tokens, targets = data.batch("text", 3, 7, 8, model)
    again = data.batch("text", 3, 7, 8, model)
    assert torch.equal(tokens, again[0]) and torch.equal(targets, again[1])
    assert tokens.shape == (8, seq) and tokens.dtype == torch.long and tokens.is_contiguous()
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # targets are the next bytes
    starts = text.train_offsets(3, 7, 8, seq)
    assert [text.decode(row) for row in tokens.tolist()] == [
        text.decode(text.corpus()[o : o + seq]) for o in starts
    ]  # the bytes of the corpus at those offsets


def test_text_needs_a_byte_vocabulary():
    with pytest.raises(ConfigError, match="vocab >= 256"):
        reference(ModelConfig(vocab=128), data="text")
    with pytest.raises(ConfigError, match="'synthetic'"):
        reference(TEXT, data="poems")


def test_generate_is_deterministic_and_as_long_as_asked():
    ref = reference(TEXT, steps=0, data="text")
    assert ref.validation_loss == pytest.approx(math.log(256), rel=0.02)  # untrained: near uniform
    a = ref.generate("ROMEO.\n", 40, seed=1)
    assert isinstance(a, str) and len(a) == 40 and a == ref.generate("ROMEO.\n", 40, seed=1)
    assert a != ref.generate("ROMEO.\n", 40, seed=2)
    greedy = ref.generate("x" * 100, 30, temperature=0)  # a prompt longer than seq: its last seq bytes
    assert len(greedy) == 30 and greedy == ref.generate("x" * 100, 30, temperature=0, seed=5)
    assert ref.generate("ROMEO.\n", 0) == ""
    with pytest.raises(ConfigError, match="prompt"):
        ref.generate("", 10)
    with pytest.raises(ConfigError, match="temperature"):
        ref.generate("a", 10, temperature=-1)


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=4),
        ParallelConfig(tp=2, pp=2, microbatches=2, sequence_parallel=True),
        ParallelConfig(dp=2, cp=2, sharding="zero3"),
        ParallelConfig(pp=2, dp=2, virtual_stages=2, schedule="interleaved", microbatches=2),
    ],
    ids=["dp4", "tp2-pp2-sp", "dp2-cp2-zero3", "pp2-v2-dp2"],
)
def test_a_layout_on_text_matches_the_reference_and_its_validation_loss(lab, cfg):
    model = TEXT if cfg.virtual_stages == 1 else TEXT.replace(layers=4)
    res = lab.run(cfg, model=model, steps=3, data="text", return_params=True)
    ref = reference(model, steps=3, global_batch=cfg.global_batch, data="text")
    assert res.data == "text" and res.params is not None and len(res.step_grads) == 3  # what the replay needs
    assert_matches(res, ref)
    # the oracle held it (checks.validation), against the reference replayed along the run: asked here too
    held = replayed(res, ref)
    assert res.validation_loss is not None and held.validation_loss is not None
    assert abs(res.validation_loss - held.validation_loss) <= FP32.losses * held.validation_loss
    assert abs(ref.validation_loss - ref.losses[-1]) < 0.5  # the same model on other bytes: near its training loss
    assert res.generate("ROMEO.\n", 20, seed=3) == res.generate("ROMEO.\n", 20, seed=3)
    back = RunResult.from_dict(res.to_dict())
    assert (back.data, back.validation_loss) == ("text", res.validation_loss)


def test_text_on_the_lab_refuses_a_small_vocabulary_before_any_engine_work(lab):
    jobs = lab.jobs
    with pytest.raises(ConfigError, match="vocab >= 256"):
        lab.run(ParallelConfig(dp=4), model=TEXT.replace(vocab=128), data="text")
    with pytest.raises(ConfigError, match="data="):
        lab.run(ParallelConfig(dp=4), model=TEXT, data="shakespeare")
    assert lab.jobs == jobs


def test_a_synthetic_run_has_no_validation_loss_and_generates_only_with_its_parameters(lab):
    res = lab.run(ParallelConfig(dp=4), model=TEXT, steps=1)
    assert res.data == "synthetic" and res.validation_loss is None and res.params is None
    with pytest.raises(ConfigError, match="return_params"):
        res.generate("a", 5)
