"""The tiny models of every family that tests/test_families.py trains (shared with its seed check)."""

from __future__ import annotations

from labkit import ModelConfig
from labkit.config import RopeScaling

GPT2 = ModelConfig(arch="gpt2", layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16)
"""GPT-2 (biases everywhere, tanh GELU, learned positions, tied head)."""
LLAMA = ModelConfig(
    arch="llama",
    layers=2,
    hidden=32,
    heads=4,
    kv_heads=2,
    ffn=64,
    vocab=128,
    seq=16,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8),
)
"""Llama 3.1 in small: GQA (2 KV heads), RoPE with the llama3 scaling (of its 4 frequencies one is
interpolated, three slowed), SwiGLU, RMSNorm, untied."""
LLAMA_TIED = LLAMA.replace(kv_heads=1, tie_embeddings=True, qkv_bias=True)
"""Tied like Llama 3.2, one KV head (shared by every tp rank), Qwen2's q/k/v biases."""
MIXTRAL = LLAMA.replace(ffn=32, experts=4, top_k=2)
"""Mixtral in small: SwiGLU experts, top-2 of 4, gates renormalised over the chosen."""
