"""The model, the data and the reference (one process, no cluster)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY

from labkit import ModelConfig, reference, theory
from labkit.engines import data
from labkit.engines.meters.memory import MemoryMeter
from labkit.engines.model import build_model


@pytest.mark.parametrize("m", [TINY, ModelConfig(), ModelConfig(layers=3, hidden=48, heads=6, ffn=96, vocab=64, seq=8)])
def test_theory_knows_every_parameter(m):
    net = build_model(m, 0)
    assert [(n, tuple(p.shape)) for n, p in net.named_parameters()] == list(theory.param_shapes(m))
    assert sum(p.numel() for p in net.parameters()) == theory.num_params(m) == m.num_params()


def test_init_is_deterministic_and_seeded():
    a, b, c = build_model(TINY, 0), build_model(TINY, 0), build_model(TINY, 1)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), n
        if p.dim() >= 2:
            assert not torch.equal(p, r), n


def test_batches_are_deterministic_and_shards_cover_them():
    t1, y1 = data.global_batch(3, 7, 8, 16, 128)
    t2, y2 = data.global_batch(3, 7, 8, 16, 128)
    assert torch.equal(t1, t2) and torch.equal(y1, y2)
    assert torch.equal(t1[:, 1:], y1[:, :-1])  # targets are the next tokens
    assert not torch.equal(t1, data.global_batch(4, 7, 8, 16, 128)[0])
    parts = [data.shard(t1, i, 4) for i in range(4)]
    assert torch.equal(torch.cat(parts), t1)
    assert parts[1].untyped_storage().nbytes() == parts[1].numel() * 8  # owns its rows


def test_a_dry_runs_batch_has_the_shapes_and_dtype_of_the_real_one():
    for kind in ("synthetic", "text"):
        real = data.batch(kind, 1, 0, 4, TINY)
        shapes = data.batch(kind, 1, 0, 4, TINY, shapes_only=True)
        assert [(t.shape, t.dtype) for t in shapes] == [(t.shape, t.dtype) for t in real], kind


def test_the_language_is_learnable():
    ref = reference(TINY, steps=40, global_batch=16)
    assert ref.losses[-1] < ref.losses[0] - 1.0, ref.losses  # from ~ln(128)=4.85 well down


def test_reference_is_reproducible():
    a = reference(TINY, steps=2)
    b = reference(TINY, steps=2)
    assert a.losses == b.losses


@pytest.mark.parametrize(
    "m, batch",
    [(TINY, 2), (TINY, 4), (ModelConfig(), 2), (ModelConfig(layers=1, hidden=48, heads=3, ffn=64, vocab=96, seq=8), 3)],
)
def test_activation_theory_equals_the_saved_tensor_meter(m, batch):
    net = build_model(m, 0)
    tokens, targets = data.global_batch(0, 0, batch, m.seq, m.vocab)
    meter = MemoryMeter()
    meter.exclude(net.parameters())
    with meter.saved_tensors():
        loss = net(tokens, targets)
    assert meter.live["activations"] == theory.activation_bytes(m, batch)
    loss.backward()
    del loss
    assert meter.live["activations"] == 0  # released with the graph
