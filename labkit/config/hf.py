"""Hugging Face config.json -> the ModelConfig fields of the same architecture (ModelConfig.from_hf).

Plain Python, no network and no weights: the bottom rung of the ladder with labkit/config/__init__.py.
Each supported class reads the fields that decide its architecture; a field whose value would
change the architecture into one labkit does not build is refused, named, with the reason
(`hf_fields` returns the problems; config.py raises them as one ConfigError). Fields that only
matter for inference or for training noise (dropout, token ids, caches, dtype) are ignored:
labkit trains without dropout.

    LlamaForCausalLM, MistralForCausalLM   arch 'llama' (RMSNorm, RoPE, SwiGLU, GQA)
    MixtralForCausalLM                     arch 'llama' with experts (SwiGLU experts, top-k router)
    Qwen2ForCausalLM                       arch 'llama' with biases on q, k, v (qkv_bias)
    GPT2LMHeadModel                        arch 'gpt2'
"""

from __future__ import annotations

import json
import pathlib

LLAMA_LIKE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
}
GPT2 = "GPT2LMHeadModel"


def load(config) -> dict:
    """A config as a dict: the dict itself, or the JSON file at a path."""
    if isinstance(config, dict):
        return config
    return json.loads(pathlib.Path(config).read_text())


def _arch_class(c: dict) -> str | None:
    names = c.get("architectures") or []
    for name in names:
        if name in LLAMA_LIKE or name == GPT2:
            return name
    by_type = {v: k for k, v in LLAMA_LIKE.items()} | {"gpt2": GPT2}
    return by_type.get(c.get("model_type"))


def _rope_scaling(c: dict, problems: list[str]):
    rs = c.get("rope_scaling")
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind != "llama3":
        problems.append(
            f"rope_scaling={rs!r}: labkit builds Llama 3.1's rope_type 'llama3' scaling only "
            "(not linear, dynamic, yarn or longrope); remove it or use a Llama 3.x config"
        )
        return None
    return {
        "factor": float(rs["factor"]),
        "low_freq_factor": float(rs.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(rs.get("high_freq_factor", 4.0)),
        "original_max_position": int(rs["original_max_position_embeddings"]),
    }


def _llama(c: dict, kind: str, seq: int | None, problems: list[str]) -> dict:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    out = {
        "arch": "llama",
        "layers": c["num_hidden_layers"],
        "hidden": hidden,
        "heads": heads,
        "kv_heads": c.get("num_key_value_heads", heads),
        "ffn": c["intermediate_size"],
        "vocab": c["vocab_size"],
        "seq": seq or c["max_position_embeddings"],
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(c.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(c, problems),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "qkv_bias": kind == "qwen2",  # Qwen2Attention: bias on q_proj, k_proj, v_proj only
    }
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r}: the llama family's SwiGLU uses 'silu'")
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        problems.append(
            f"head_dim={head_dim}: labkit's attention has head_dim = hidden_size / num_attention_heads "
            f"= {hidden // heads}"
        )
    if c.get("attention_bias"):
        problems.append("attention_bias=True: biases on q, k, v and o are not built (Qwen2's q, k, v biases are)")
    if c.get("mlp_bias"):
        problems.append("mlp_bias=True: the SwiGLU MLP has no biases in labkit")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={c['partial_rotary_factor']}: RoPE rotates every dimension here")
    window = c.get("sliding_window")
    if kind == "qwen2":
        window = window if c.get("use_sliding_window") else None
    if window is not None and window < out["seq"]:
        problems.append(
            f"sliding_window={window} < seq={out['seq']}: sliding-window attention is not built; "
            "pass seq <= sliding_window (the window then changes nothing)"
        )
    if kind == "mixtral":
        out["experts"] = c["num_local_experts"]
        out["top_k"] = c["num_experts_per_tok"]
        if c.get("router_jitter_noise", 0.0):
            problems.append(f"router_jitter_noise={c['router_jitter_noise']}: the router is deterministic here")
    return out


def _gpt2(c: dict, seq: int | None, problems: list[str]) -> dict:
    hidden = c["n_embd"]
    out = {
        "arch": "gpt2",
        "layers": c["n_layer"],
        "hidden": hidden,
        "heads": c["n_head"],
        "ffn": c.get("n_inner") or 4 * hidden,
        "vocab": c["vocab_size"],
        "seq": seq or c["n_positions"],
        "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
        "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
    }
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(
            f"activation_function={c['activation_function']!r}: GPT-2's MLP uses the tanh GELU ('gelu_new')"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if c.get(flag):
            problems.append(f"{flag}=True: not part of GPT-2 as labkit builds it")
    if not c.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=False: attention is scaled by 1/sqrt(head_dim) here")
    return out


def hf_fields(config, seq: int | None = None) -> tuple[dict, list[str]]:
    """(ModelConfig keyword arguments, problems) of a Hugging Face config (dict or path)."""
    c = load(config)
    cls = _arch_class(c)
    if cls is None:
        known = ", ".join([*LLAMA_LIKE, GPT2])
        return {}, [
            f"architectures={c.get('architectures')!r} (model_type={c.get('model_type')!r}): supported: {known}"
        ]
    problems: list[str] = []
    fields = _gpt2(c, seq, problems) if cls == GPT2 else _llama(c, LLAMA_LIKE[cls], seq, problems)
    # a value that is the family's default stays unset (None), as in a config written by hand
    if fields.get("kv_heads") == fields["heads"]:
        fields["kv_heads"] = None
    if fields["tie_embeddings"] == (fields["arch"] == "gpt2"):
        fields["tie_embeddings"] = None
    return fields, problems
