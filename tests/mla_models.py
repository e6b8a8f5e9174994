"""The small DeepSeek-V3-shaped models the MLA tests train (tests/test_mla_strategies.py; the refusals of
tests/test_mla.py)."""

from __future__ import annotations

from labkit import ModelConfig

MLA = ModelConfig(
    arch="deepseek_v3",
    layers=2,
    hidden=32,
    heads=4,
    ffn=64,
    vocab=128,
    seq=16,
    q_lora_rank=16,
    kv_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    yarn={"factor": 4.0, "original_max_position": 8},
)
"""DeepSeek-V3 in small: both latents, q/k 12 wide and v 6 (padded to 12 for the kernel), YaRN over
an original context of 8 with 16 positions (its mscale in the softmax scale)."""
MLA_3 = MLA.replace(layers=3)
MLA_MOE = MLA.replace(experts=4, top_k=2, ffn=32)
