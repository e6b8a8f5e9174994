"""Hugging Face config.json -> ModelConfig fields for the dense attention families (hf/__init__.py
dispatches here): Qwen3 dense, SmolLM3 and Gemma 3's text model. Each reads the fields that decide
its architecture in transformers' own modeling file (5.24: models/qwen3/modeling_qwen3.py,
smollm3/modeling_smollm3.py, gemma3/modeling_gemma3.py), in both spellings a config comes in: as
published (rope_theta, rope_scaling, sliding_window_pattern) and as transformers >= 5 writes it
(rope_parameters, layer_types). A field whose value labkit does not build is refused by name.

    Qwen3ForCausalLM       arch 'llama', qk_norm, kv_channels = head_dim (128)
    Qwen3MoeForCausalLM    the same attention; its experts read by hf/moe.py (hf/__init__.py joins them)
    SmolLM3ForCausalLM     arch 'llama', nope_interval (every 4th layer without RoPE)
    Gemma3ForCausalLM      arch 'gemma3' (Gemma3ForConditionalGeneration: its text_config, the
                           vision tower left out), sliding-window layers in a pattern, their own
                           RoPE base, query_pre_attn_scalar, q/k norms
    GptOssForCausalLM      arch 'gpt_oss': hf/gpt_oss.py
"""

from __future__ import annotations

from labkit.config.hf.gpt_oss import read_gpt_oss

FAMILIES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention here, its experts in hf/moe.py
    "SmolLM3ForCausalLM": "smollm3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",  # read by hf/gpt_oss.py
}
MODEL_TYPES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def family_of(c: dict) -> str | None:
    """The family a config names ('qwen3', 'smollm3', 'gemma3'), or None."""
    for name in c.get("architectures") or []:
        if name in FAMILIES:
            return FAMILIES[name]
    cls = MODEL_TYPES.get(c.get("model_type"))
    return FAMILIES.get(cls) if cls else ("gemma3" if c.get("model_type") == "gemma3" else None)


def _theta(c: dict, read, problems: list[str], layer_type: str | None, default: float) -> float | None:
    """A RoPE base: rope_parameters (transformers >= 5; per layer type for Gemma 3), else rope_theta
    (or Gemma's rope_local_base_freq for the local layers), else `default` (the config class's)."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        return read(params, "rope_theta", float, problems, default, "rope_parameters.")
    key = "rope_local_base_freq" if layer_type == "sliding_attention" else "rope_theta"
    return read(c, key, float, problems, default)


def _rope_kind(c: dict, layer_type: str | None) -> dict | None:
    """The scaling a config asks for (rope_scaling, or rope_parameters of `layer_type`), None when default."""
    params = c.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]
    scaling = c.get("rope_scaling") or params
    if not isinstance(scaling, dict):
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else scaling


GEMMA3_DEFAULTS = {"vocab_size": 262_208, "max_position_embeddings": 131_072}
"""What a Gemma 3 text_config may leave out (the published 4B-27B ones do): Gemma3TextConfig's defaults."""


def _common(c: dict, read, missing: list[str], seq: int | None, defaults: dict) -> dict:
    heads = read(c, "num_attention_heads", int, missing)
    return {
        "layers": read(c, "num_hidden_layers", int, missing),
        "hidden": read(c, "hidden_size", int, missing),
        "heads": heads,
        "kv_heads": read(c, "num_key_value_heads", int, missing, heads),
        "ffn": read(c, "intermediate_size", int, missing),
        "vocab": read(c, "vocab_size", int, missing, *defaults.get("vocab_size", ())),
        "seq": seq or read(c, "max_position_embeddings", int, missing, *defaults.get("max_position_embeddings", ())),
        "norm_eps": read(c, "rms_norm_eps", float, missing, 1e-6),
    }


def _kv_channels(c: dict, out: dict, read, problems: list[str], default) -> None:
    """head_dim, kept only where it differs from hidden / heads (a config written by hand has no field then)."""
    hd = read(c, "head_dim", int, problems, default)
    if hd is not None and out["hidden"] and out["heads"] and hd != out["hidden"] // out["heads"]:
        out["kv_channels"] = hd


def _no_sliding(c: dict, kind: str, problems: list[str]) -> None:
    # Qwen3 and SmolLM3 ship sliding_window fields that use_sliding_window leaves off (every released size)
    if c.get("use_sliding_window"):
        problems.append(
            f"use_sliding_window=True on {kind}: its sliding layers (max_window_layers / layer_types) are not "
            "built for this family; set use_sliding_window=false, as every released config has it"
        )


def _refuse_common(c: dict, problems: list[str], act_key: str, act: str) -> None:
    if c.get(act_key, act) != act:
        problems.append(f"{act_key}={c[act_key]!r}: this family's gated MLP uses {act!r}")
    if c.get("attention_bias"):
        problems.append("attention_bias=True: biases on q, k, v and o are not built for this family")
    if c.get("mlp_bias"):
        problems.append("mlp_bias=True: the gated MLP has no biases in labkit")


def read_family(c: dict, kind: str, seq: int | None, read, problems: list[str]) -> dict:
    """ModelConfig fields of a Qwen3 / SmolLM3 / Gemma 3 config (`read`: hf/keys.py's checked reader)."""
    if kind == "gpt_oss":
        return read_gpt_oss(c, seq, problems)
    if kind == "gemma3" and isinstance(c.get("text_config"), dict):
        c = c["text_config"]  # the multimodal checkpoint: its language model, Gemma3ForCausalLM
    missing: list[str] = []
    defaults = {k: (v,) for k, v in GEMMA3_DEFAULTS.items()} if kind == "gemma3" else {}
    out = _common(c, read, missing, seq, defaults)
    if missing:
        problems += missing
        return {}
    if kind == "gemma3":
        return _gemma3(c, out, read, problems)
    out["arch"] = "llama"
    out["rope_theta"] = _theta(c, read, problems, None, 10000.0)
    out["tie_embeddings"] = read(c, "tie_word_embeddings", bool, problems, kind == "smollm3")
    _refuse_common(c, problems, "hidden_act", "silu")
    _no_sliding(c, kind, problems)
    if _rope_kind(c, None) is not None:
        problems.append(f"rope_scaling={_rope_kind(c, None)!r}: {kind}'s released configs train with plain RoPE here")
    # Qwen3Attention (Qwen3-MoE's too): q_norm, k_norm over head_dim; head_dim 128 apart from hidden / heads
    if kind in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
        # the config classes' defaults when head_dim is absent: Qwen3Config 128, Qwen3MoeConfig none (h / heads)
        _kv_channels(c, out, read, problems, 128 if kind == "qwen3" else None)
        return out
    # SmolLM3: no_rope_layers[i] = 1 where layer i rotates; the released configs drop every 4th
    n = read(c, "no_rope_layer_interval", int, problems, 4)
    _kv_channels(c, out, read, problems, None)
    said = c.get("no_rope_layers")
    rotating = [int((i + 1) % n != 0) for i in range(out["layers"])] if n else [1] * out["layers"]
    if said is not None and list(said) != rotating:
        nope = [i for i, r in enumerate(said) if not r]
        problems.append(
            f"no_rope_layers leaves layers {nope} unrotated: labkit builds every no_rope_layer_interval-th "
            f"layer without RoPE (nope_interval={n}: layers {[i for i, r in enumerate(rotating) if not r]})"
        )
    out["nope_interval"] = n
    return out


def _gemma3(c: dict, out: dict, read, problems: list[str]) -> dict:
    """Gemma3TextConfig's fields (transformers 5.24 configuration_gemma3.py): head_dim 256 by default,
    query_pre_attn_scalar 256, layer i global iff (i + 1) % sliding_window_pattern == 0 (6), global
    RoPE base 1e6 (linear-scaled by rope_scaling's factor on 4B-27B), local 1e4 unscaled."""
    out["arch"] = "gemma3"
    _kv_channels(c, out, read, problems, 256)
    out["qk_norm"] = True
    out["tie_embeddings"] = read(c, "tie_word_embeddings", bool, problems, True)
    out["query_pre_attn_scalar"] = read(c, "query_pre_attn_scalar", float, problems, 256.0)
    out["sliding_window"] = read(c, "sliding_window", int, problems, 4096)
    pattern = read(c, "sliding_window_pattern", int, problems, 6)
    types = c.get("layer_types")
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(out["layers"])]
    if types is not None and list(types) != expected:
        problems.append(
            f"layer_types={types!r}: labkit builds Gemma 3's pattern, every sliding_window_pattern-th layer "
            f"global (pattern {pattern}: {expected})"
        )
    out["window_pattern"] = pattern
    out["rope_theta"] = _theta(c, read, problems, "full_attention", 1_000_000.0)
    out["rope_local_theta"] = _theta(c, read, problems, "sliding_attention", 10_000.0)
    scaling = _rope_kind(c, "full_attention")
    if scaling is not None:
        if scaling.get("rope_type", scaling.get("type")) != "linear":
            problems.append(f"rope_scaling={scaling!r}: Gemma 3's global layers use linear scaling only here")
        else:
            out["rope_linear_factor"] = read(scaling, "factor", float, problems, within="rope_scaling.")
    local = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.sliding_attention={local!r}: Gemma 3's local layers use plain RoPE")
    _refuse_common(c, problems, "hidden_activation", "gelu_pytorch_tanh")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(key) is not None:  # Gemma 2's, null in every Gemma 3 config
            problems.append(f"{key}={c[key]}: soft-capping (Gemma 2) is not built; Gemma 3 has none")
    if c.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=True: labkit trains causal decoders only")
    return out
