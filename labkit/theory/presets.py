"""Published models as lab ModelConfigs, for estimates at scale (the ScaleExplorer, `labkit estimate`).

The lab model is GPT-style: multi-head attention (4h² per block), a two-matrix GELU MLP, learned
positions and an untied LM head. Where a published model differs (Llama's SwiGLU MLP with
three matrices, grouped-query attention), `ffn` is chosen so that each block holds the same
number of parameters as the original; the total Ψ then matches the published count, and so do
the model-state bytes (ZeRO accounting is per parameter). Activations are those of the lab's
block at the published width, so they are an approximation for these models.

    ffn = (attention + MLP parameters of the published block - 4h²) / (experts · 2h)

Each preset cites its source; `PUBLISHED_PARAMS` holds the count the source reports and a test
checks Ψ against it.
"""

from __future__ import annotations

from labkit.config import ModelConfig

GPT2_124M = ModelConfig(layers=12, hidden=768, heads=12, ffn=3072, vocab=50304, seq=1024)
"""GPT-2 small: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019),
table 2; vocab 50257 padded to 50304 (nanoGPT's choice, a multiple of 64 so tp can split it).
GPT-2 ties its LM head to the token embedding; the lab's head is untied, so Ψ here is the
published 124M plus vocab·h = 38.6M."""

LLAMA_7B = ModelConfig(layers=32, hidden=4096, heads=32, ffn=16512, vocab=32000, seq=4096)
"""Llama 2 7B: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models" (2023),
table 1 and the released config (h 4096, 32 layers, 32 heads, SwiGLU width 11008).
ffn = 3/2 · 11008 (three SwiGLU matrices as two)."""

LLAMA_13B = ModelConfig(layers=40, hidden=5120, heads=40, ffn=20736, vocab=32000, seq=4096)
"""Llama 2 13B: Touvron et al. (2023), table 1 (h 5120, 40 layers, 40 heads, SwiGLU width
13824). ffn = 3/2 · 13824."""

LLAMA_70B = ModelConfig(layers=80, hidden=8192, heads=64, ffn=35840, vocab=32000, seq=4096)
"""Llama 2 70B: Touvron et al. (2023), table 1 (h 8192, 80 layers, 64 heads with 8 KV heads
(GQA), SwiGLU width 28672). ffn = (2h² + 2h·1024 + 3h·28672 - 4h²) / 2h = 35840."""

LLAMA_405B = ModelConfig(layers=126, hidden=16384, heads=128, ffn=64512, vocab=128256, seq=8192)
"""Llama 3.1 405B: Llama Team, "The Llama 3 Herd of Models" (2024), table 3 (h 16384,
126 layers, 128 heads with 8 KV heads, FFN 53248, vocab 128256, pre-training sequence 8192).
ffn = (2h² + 2h·1024 + 3h·53248 - 4h²) / 2h = 64512."""

MIXTRAL_8X7B = ModelConfig(layers=32, hidden=4096, heads=32, ffn=21120, vocab=32000, seq=32768, experts=8, top_k=2)
"""Mixtral 8x7B: Jiang et al., "Mixtral of Experts" (2024), table 1 (h 4096, 32 layers,
32 heads with 8 KV heads, expert width 14336, 8 experts, top-2, context 32768).
ffn = (2h² + 2h·1024 + 8 · 3h·14336 - 4h²) / (8 · 2h) = 21120."""

PRESETS: dict[str, ModelConfig] = {
    "gpt2-124m": GPT2_124M,
    "llama-7b": LLAMA_7B,
    "llama-13b": LLAMA_13B,
    "llama-70b": LLAMA_70B,
    "llama-405b": LLAMA_405B,
    "mixtral-8x7b": MIXTRAL_8X7B,
}

PUBLISHED_PARAMS: dict[str, float] = {
    "gpt2-124m": 124e6,  # tied head; the lab's untied head adds vocab * hidden
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "llama-70b": 69.0e9,
    "llama-405b": 405e9,
    "mixtral-8x7b": 46.7e9,
}
"""Parameter counts as the sources report them (Llama 2's model card: 6.74B, 13.0B, 69.0B)."""
