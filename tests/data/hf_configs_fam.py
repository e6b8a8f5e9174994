"""Published config.json files of the dense attention families (tests/test_families_fam.py),
as ModelConfig.from_hf reads them: each dict is the config as published (the source above it),
the fields that decide the architecture and the bookkeeping ones kept as they are."""

from __future__ import annotations

# https://huggingface.co/Qwen/Qwen3-8B-Base/blob/main/config.json (transformers 4.51.0; the same
# architecture as Qwen/Qwen3-8B, whose config differs in max_position_embeddings 40960 and eos)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# https://huggingface.co/HuggingFaceTB/SmolLM3-3B/blob/main/config.json (and the release post,
# huggingface/blog smollm3.md: 36 layers, GQA with 4 KV heads, NoPE on every 4th layer, tied)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "max_window_layers": 28,
    "mlp_bias": False,
    "model_type": "smollm3",
    "no_rope_layer_interval": 4,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "pretraining_tp": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0.dev0",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 128256,
}

# https://huggingface.co/google/gemma-3-27b-pt/blob/main/config.json: a Gemma3ForConditionalGeneration
# whose text_config is the language model (Gemma3ForCausalLM); the fields it leaves out take
# Gemma3TextConfig's defaults (vocab 262208, rope_theta 1e6, rope_local_base_freq 1e4,
# sliding_window_pattern 6). The same sizes: AI-Hypercomputer/maxtext MaxText/configs/models/gemma3-27b.yml
# (62 layers, emb 5376, 32 heads, 16 KV heads, mlp 21504, head_dim 128, window 1024, linear factor 8)
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
}
