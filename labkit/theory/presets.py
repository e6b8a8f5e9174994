"""Published models, exactly as built (ModelConfig.arch), for estimates at scale (the ScaleExplorer,
`labkit estimate`, notebook 10). Each is what ModelConfig.from_hf makes of the model's Hugging Face
config.json (tests/data/hf_configs.py holds those configs and checks it), with `seq` the training
sequence of the source cited (the configs' max_position_embeddings is the longest context, not
what a step trains on). `PUBLISHED_PARAMS` is each model's exact parameter count (the safetensors
total of its Hugging Face checkpoint); theory.num_params equals it, and a test checks.

The names of the first build stay (llama-7b is Llama 2 7B, llama-70b Llama 2 70B, llama-405b
Llama 3.1 405B), now exact; the Llama 3.x models have names of their own.
"""

from __future__ import annotations

from labkit.config import ModelConfig, RopeScaling
from labkit.config.latent import YarnRope

GPT2_124M = ModelConfig(arch="gpt2", layers=12, hidden=768, heads=12, ffn=3072, vocab=50257, seq=1024)
"""GPT-2 small: Radford et al., "Language Models are Unsupervised Multitask Learners" (2019),
table 2; huggingface.co/openai-community/gpt2 config.json (n_embd 768, n_layer 12, n_head 12,
n_positions 1024, vocab 50257, gelu_new, tied head). vocab 50257 is odd: tp > 1 needs
`.replace(vocab_divisible_by=128)`, Megatron's padding (the padding rows out of the loss: the same
model; nanoGPT's 50304 is a vocab of 50304, another model)."""

LLAMA2_7B = ModelConfig(arch="llama", layers=32, hidden=4096, heads=32, ffn=11008, vocab=32000, seq=4096)
"""Llama 2 7B: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models" (2023),
table 1; huggingface.co/meta-llama/Llama-2-7b-hf config.json (h 4096, 32 layers, 32 heads = KV
heads, SwiGLU 11008, vocab 32000, rope_theta 1e4, context 4096)."""

LLAMA2_13B = ModelConfig(arch="llama", layers=40, hidden=5120, heads=40, ffn=13824, vocab=32000, seq=4096)
"""Llama 2 13B: Touvron et al. (2023), table 1; huggingface.co/meta-llama/Llama-2-13b-hf config.json
(h 5120, 40 layers, 40 heads, SwiGLU 13824)."""

LLAMA2_70B = ModelConfig(arch="llama", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000, seq=4096)
"""Llama 2 70B: Touvron et al. (2023), table 1; huggingface.co/meta-llama/Llama-2-70b-hf config.json
(h 8192, 80 layers, 64 heads, 8 KV heads, SwiGLU 28672)."""

LLAMA31_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
"""Llama 3.1's rope_scaling (rope_type 'llama3'), as in its config.json."""

LLAMA31_8B = ModelConfig(
    arch="llama",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn=14336,
    vocab=128256,
    seq=8192,
    rope_theta=500000.0,
    rope_scaling=LLAMA31_ROPE,
)
"""Llama 3.1 8B: Llama Team, "The Llama 3 Herd of Models" (2024), table 3;
huggingface.co/meta-llama/Llama-3.1-8B config.json. seq 8192: the pre-training sequence (table 3),
torchtitan's llama3 8B training run."""

LLAMA31_70B = LLAMA31_8B.replace(layers=80, hidden=8192, heads=64, ffn=28672)
"""Llama 3.1 70B: ibid., table 3; huggingface.co/meta-llama/Llama-3.1-70B config.json."""

LLAMA31_405B = LLAMA31_8B.replace(layers=126, hidden=16384, heads=128, ffn=53248)
"""Llama 3.1 405B: ibid., table 3 (126 layers: uneven pipeline stages, ParallelConfig.stage_layers);
huggingface.co/meta-llama/Llama-3.1-405B config.json."""

LLAMA32_1B = ModelConfig(
    arch="llama",
    layers=16,
    hidden=2048,
    heads=32,
    kv_heads=8,
    ffn=8192,
    vocab=128256,
    seq=8192,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192),
    tie_embeddings=True,
)
"""Llama 3.2 1B: huggingface.co/meta-llama/Llama-3.2-1B config.json (h 2048, 16 layers, 32 heads,
8 KV heads, SwiGLU 8192, tied head, rope factor 32)."""

MIXTRAL_8X7B = ModelConfig(
    arch="llama",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn=14336,
    vocab=32000,
    seq=32768,
    experts=8,
    top_k=2,
    rope_theta=1e6,
)
"""Mixtral 8x7B: Jiang et al., "Mixtral of Experts" (2024), table 1; huggingface.co/mistralai/
Mixtral-8x7B-v0.1 config.json (h 4096, 32 layers, 32 heads, 8 KV heads, 8 SwiGLU experts of
14336, top-2, rope_theta 1e6, context 32768)."""

DEEPSEEK_V3_DENSE = ModelConfig(
    arch="deepseek_v3",
    layers=61,
    hidden=7168,
    heads=128,
    ffn=18432,
    vocab=129280,
    seq=4096,
    norm_eps=1e-6,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    yarn=YarnRope(
        factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0
    ),
)
"""DeepSeek-V3's attention, norms, embedding and head with every one of its 61 layers dense (its
first_k_dense_replace = 61): DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437),
section 4.2 (61 layers, h 7168, 128 heads, d_c 512, d'_c 1536, d_h 128, d_h^R 64, dense FFN
18432, 4K training sequence) and 4.3 (YaRN s = 40, alpha 1, beta 32, sqrt(t) = 0.1 ln s + 1);
huggingface.co/deepseek-ai/DeepSeek-V3 config.json, read by from_hf with first_k_dense_replace=61
(tests/test_mla.py). 37,445,852,160 parameters, transformers' DeepseekV3ForCausalLM count of the same
config. Not in PRESETS: no checkpoint has this shape; the published model (671B, its 58 MoE layers)
comes with the MoE fields."""
QWEN3_8B = ModelConfig(
    arch="llama",
    layers=36,
    hidden=4096,
    heads=32,
    kv_heads=8,
    ffn=12288,
    vocab=151936,
    seq=32768,
    rope_theta=1e6,
    norm_eps=1e-6,
    qk_norm=True,
)
"""Qwen3 8B: huggingface.co/Qwen/Qwen3-8B-Base config.json (h 4096, 36 layers, 32 heads of 128, 8 KV
heads, SwiGLU 12288, per-head q/k RMSNorm, untied head, rope_theta 1e6, context 32768); Qwen3
technical report (Yang et al. 2025), table 1."""

SMOLLM3_3B = ModelConfig(
    arch="llama",
    layers=36,
    hidden=2048,
    heads=16,
    kv_heads=4,
    ffn=11008,
    vocab=128256,
    seq=65536,
    rope_theta=5e6,
    norm_eps=1e-6,
    tie_embeddings=True,
    nope_interval=4,
)
"""SmolLM3 3B: huggingface.co/HuggingFaceTB/SmolLM3-3B config.json (h 2048, 36 layers, 16 heads, 4 KV
heads, SwiGLU 11008, no RoPE on every 4th layer, tied, rope_theta 5e6, context 65536)."""

GEMMA3_27B = ModelConfig(
    arch="gemma3",
    layers=62,
    hidden=5376,
    heads=32,
    kv_heads=16,
    kv_channels=128,
    ffn=21504,
    vocab=262208,
    seq=131072,
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_linear_factor=8.0,
    norm_eps=1e-6,
    qk_norm=True,
    sliding_window=1024,
    window_pattern=6,
    query_pre_attn_scalar=168.0,
)
"""Gemma 3 27B's language model (Gemma3ForCausalLM): huggingface.co/google/gemma-3-27b-pt config.json's
text_config (h 5376, 62 layers, 32 heads of 128, 16 KV heads, GeGLU 21504, query_pre_attn_scalar
168, window 1024 on five layers of six, linear RoPE factor 8 on the global ones), the rest
Gemma3TextConfig's defaults (vocab 262208, rope bases 1e6 / 1e4, context 131072); Gemma Team,
"Gemma 3 Technical Report" (2025), section 2."""

DEEPSEEK_V3 = DEEPSEEK_V3_DENSE.replace(
    experts=256,
    top_k=8,
    moe_ffn=2048,
    shared_experts=1,
    norm_topk_prob=True,
    router="sigmoid",
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    dense_layers=3,
)
"""DeepSeek-V3 (671B): DEEPSEEK_V3_DENSE's attention with layers 3..60 MoE, 256 routed experts of width 2048
(top-8 within 4 of 8 groups, sigmoid gates scaled by 2.5) and one shared: the technical report (arXiv
2412.19437) section 4.2 and huggingface.co/deepseek-ai/DeepSeek-V3 config.json, which from_hf reads into
this (tests/test_families_moe.py: 671,026,404,352 parameters, transformers' count). The MTP module is left
out, as transformers leaves it out."""

QWEN3_30B_A3B = QWEN3_8B.replace(
    layers=48, hidden=2048, heads=32, kv_heads=4, kv_channels=128, ffn=6144, seq=40960, experts=128, top_k=8,
    moe_ffn=768, norm_topk_prob=True,
)  # fmt: skip
"""Qwen3-30B-A3B: huggingface.co/Qwen/Qwen3-30B-A3B config.json (48 layers, h 2048, 32 heads of 128, 4 KV heads,
128 experts of width 768, top-8, gates renormalised, q/k norms, rope_theta 1e6, context 40960)."""

GPT_OSS_YARN = YarnRope(factor=32.0, original_max_position=4096, mscale=0.0, mscale_all_dim=0.0, truncate=False)
"""GPT-OSS's rope_scaling: YaRN x32 from 4096 positions, the correction range unrounded, cos/sin times
mscale(32) = 1.3466 (no mscale pair in its config.json)."""

GPT_OSS_20B = ModelConfig(
    arch="gpt_oss", layers=24, hidden=2880, heads=64, kv_heads=8, kv_channels=64, ffn=2880, vocab=201088,
    seq=131072, experts=32, top_k=4, rope_theta=150000.0, yarn=GPT_OSS_YARN, sliding_window=128, window_pattern=2,
)  # fmt: skip
"""gpt-oss-20b: huggingface.co/openai/gpt-oss-20b config.json (24 layers, h 2880, 64 heads of 64, 8 KV heads,
32 experts of width 2880, top-4, window 128 on every other layer from the first, rope_theta 150000, YaRN,
context 131072); OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), table 1: 20.91B parameters, 3.61B
active (the unembedding counted, the embedding not)."""

GPT_OSS_120B = GPT_OSS_20B.replace(layers=36, experts=128)
"""gpt-oss-120b: huggingface.co/openai/gpt-oss-120b config.json, 20b's with 36 layers of 128 experts; the model
card's table 1: 116.83B parameters, 5.13B active."""

PRESETS: dict[str, ModelConfig] = {
    "gpt2-124m": GPT2_124M,
    "llama-7b": LLAMA2_7B,
    "llama-13b": LLAMA2_13B,
    "llama-70b": LLAMA2_70B,
    "llama3.2-1b": LLAMA32_1B,
    "llama3.1-8b": LLAMA31_8B,
    "llama3.1-70b": LLAMA31_70B,
    "llama-405b": LLAMA31_405B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "qwen3-8b": QWEN3_8B,
    "smollm3-3b": SMOLLM3_3B,
    "gemma3-27b": GEMMA3_27B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": DEEPSEEK_V3,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
}

PUBLISHED_PARAMS: dict[str, int] = {
    "gpt2-124m": 124_439_808,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
    "llama3.2-1b": 1_235_814_400,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,
    # transformers 5.24's Qwen3ForCausalLM / SmolLM3ForCausalLM / Gemma3ForCausalLM built on
    # the meta device from the published config (tests/test_families_fam.py counts them again); Qwen3 8B's
    # Hub page lists 8.19B, SmolLM3's 3.08B; Gemma 3 27B's 27.4B includes its vision tower
    "qwen3-8b": 8_190_735_360,
    "smollm3-3b": 3_075_098_624,
    "gemma3-27b": 27_009_346_304,
    # transformers' Qwen3MoeForCausalLM / DeepseekV3ForCausalLM on the meta device (tests/test_families_moe.py);
    # the Hub pages list 30.5B and 671B (DeepSeek's 685B counts the MTP module too)
    "qwen3-30b-a3b": 30_532_122_624,
    "deepseek-v3": 671_026_404_352,
    # transformers' GptOssForCausalLM on the meta device (tests/test_gpt_oss.py); the model card's 20.91B, 116.83B
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}
"""Exact parameter counts of the published checkpoints (Hugging Face's safetensors totals)."""

# the names the first build used, kept working; LLAMA_70B was Llama 2 70B, LLAMA_405B Llama 3.1 405B
LLAMA_7B, LLAMA_13B, LLAMA_70B, LLAMA_405B = LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, LLAMA31_405B

ALIASES: dict[str, str] = {
    "llama-3.1-8b": "llama3.1-8b",
    "llama-3.1-70b": "llama3.1-70b",
    "llama-3.1-405b": "llama-405b",
    "llama3.1-405b": "llama-405b",
    "llama-3.2-1b": "llama3.2-1b",
}
"""Other spellings of the presets' names (Meta writes 'Llama-3.1-70B'), for the CLI."""


def preset(name: str) -> ModelConfig | None:
    """The preset called `name` (or one of its ALIASES), or None."""
    return PRESETS.get(ALIASES.get(name, name))
