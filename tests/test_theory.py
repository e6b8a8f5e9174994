"""Theory against published numbers (no cluster)."""

from __future__ import annotations

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.layout.buckets import lab_buckets, torch_ddp_buckets

GB = 1e9


def test_zero_paper_worked_example():
    # Rajbhandari et al. 2020, figure 1: Ψ = 7.5B, N_d = 64, K = 12
    s = theory.model_state_bytes(7.5e9, 64, "bf16")
    assert s["none"]["total"] / GB == pytest.approx(120.0)
    assert s["zero1"]["total"] / GB == pytest.approx(31.4, abs=0.05)
    assert s["zero2"]["total"] / GB == pytest.approx(16.6, abs=0.05)
    assert s["zero3"]["total"] / GB == pytest.approx(1.9, abs=0.05)


def test_fp32_states_are_4_4_8():
    s = theory.model_state_bytes(1000, 4, "fp32")["none"]
    assert (s["params"], s["grads"], s["optimizer"]) == (4000, 4000, 8000)


def test_korthikanti_table_2():
    # GPT-3 175B row of Korthikanti et al. (s=2048, h=12288, a=96, t=8), 16-bit activations
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert theory.korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert theory.korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert theory.korthikanti_layer_bytes(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert theory.korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert theory.korthikanti_layer_bytes(s, b, h, a, t, recompute="full") == 2 * sbh
    # the paper's headline: SP + selective recompute saves ~5x vs TP alone at this size
    ratio = theory.korthikanti_layer_bytes(s, b, h, a, t) / theory.korthikanti_layer_bytes(
        s, b, h, a, t, True, "selective"
    )
    assert 4.5 < ratio < 6


def test_bubble_formulas():
    assert theory.pipeline_bubble(1, 8) == 0
    assert theory.pipeline_bubble(4, 4) == pytest.approx(3 / 7)
    assert theory.pipeline_bubble(4, 8, v=2) == pytest.approx(3 / 19)


def test_buckets():
    assert lab_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert lab_buckets([4, 20, 4], 8) == [[2], [1], [0]]
    assert torch_ddp_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert torch_ddp_buckets([4, 4, 4], 6) == [[2, 1], [0]]


def test_ddp_estimate_shape():
    m = ModelConfig()
    est = theory.estimate(ParallelConfig(dp=4), m)
    psi = theory.num_params(m)
    assert est.memory[0]["params"] == 4 * psi and est.memory[0]["optimizer"] == 8 * psi
    rows = est.comm_table()
    assert {r["rank"] for r in rows} == {0, 1, 2, 3}
    assert sum(r["wire_bytes"] for r in rows if r["rank"] == 0) == pytest.approx(2 * 3 / 4 * 4 * psi)
