"""Hugging Face config.json -> the ModelConfig fields of the same architecture (ModelConfig.from_hf).

Plain Python, no network and no weights: the bottom rung of the ladder with the configs (labkit/config/model.py).
Each supported class reads the fields that decide its architecture; a field whose value would
change the architecture into one labkit does not build is refused, named, with the reason
(`hf_fields` returns the problems; labkit/config/model.py raises them as one ConfigError), and
so is a key that is missing or of the wrong type, by its name. Fields that only matter for
inference or for training noise (dropout, token ids, caches, dtype) are ignored: labkit trains
without dropout. A config is a dict, or a local config.json (or the folder holding one): labkit
never downloads, so a Hub id is refused with the way to fetch its config.json.

    LlamaForCausalLM, MistralForCausalLM   arch 'llama' (RMSNorm, RoPE, SwiGLU, GQA; Mistral: a window on every layer)
    MixtralForCausalLM                     arch 'llama' with experts (SwiGLU experts, top-k router)
    Qwen2ForCausalLM                       arch 'llama' with biases on q, k, v (qkv_bias)
    GPT2LMHeadModel                        arch 'gpt2'
    DeepseekV3ForCausalLM                  arch 'deepseek_v3' (MLA, YaRN; its MoE layers: hf/moe.py)
    Qwen3ForCausalLM, SmolLM3ForCausalLM,  the dense attention families: hf/families.py
    Gemma3ForCausalLM
    Qwen3MoeForCausalLM                    Qwen3's attention (hf/families.py), its MoE layers (hf/moe.py)
"""

from __future__ import annotations

import json
import os
import pathlib

from labkit.config.choices import ConfigError, family
from labkit.config.hf.families import FAMILIES, family_of, read_family
from labkit.config.hf.keys import _read, yarn_fields
from labkit.config.hf.moe import QWEN3_MOE, moe_fields

LLAMA_LIKE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
}
GPT2 = "GPT2LMHeadModel"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"


def load(config) -> dict:
    """A config as a dict: the dict itself, or the JSON of a local config.json (a path to it, or
    to the folder holding it). ConfigError for anything else, with what to give instead."""
    if isinstance(config, dict):
        return config
    if config is None:
        raise ConfigError(
            [
                "ModelConfig.from_hf(None): no config given; pass a Hugging Face config.json as a dict, "
                "or a local file's path"
            ]
        )
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            [
                f"ModelConfig.from_hf({config!r}): give a Hugging Face config.json as a dict, or the path "
                f"of a local config.json, not a {type(config).__name__}"
            ]
        )
    path = pathlib.Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            [
                f"ModelConfig.from_hf({str(config)!r}): no file {str(path)!r} here. labkit reads a local "
                "config.json or a dict and never downloads; for a Hub model fetch its config.json first, e.g. "
                f"huggingface_hub.hf_hub_download({str(config)!r}, 'config.json'), and pass that path"
            ]
        )
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"ModelConfig.from_hf: {str(path)!r} is not a readable JSON file ({e})"]) from None
    if not isinstance(out, dict):
        raise ConfigError([f"ModelConfig.from_hf: {str(path)!r} holds a {type(out).__name__}, not a JSON object"])
    return out


def _arch_class(c: dict) -> str | None:
    # the class named in "architectures" decides; model_type only where that names none we build
    names = c.get("architectures") or []
    for name in names:
        if name in LLAMA_LIKE or name in (GPT2, DEEPSEEK_V3):
            return name
    by_type = {v: k for k, v in LLAMA_LIKE.items()} | {"gpt2": GPT2, "deepseek_v3": DEEPSEEK_V3}
    return by_type.get(c.get("model_type"))


def _rope_scaling(c: dict, problems: list[str]):
    rs = c.get("rope_scaling")
    if rs is None:
        return None
    # transformers' older configs call it "type"
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
        "factor": _read(rs, "factor", float, problems, within="rope_scaling."),
        "low_freq_factor": _read(rs, "low_freq_factor", float, problems, 1.0, "rope_scaling."),
        "high_freq_factor": _read(rs, "high_freq_factor", float, problems, 4.0, "rope_scaling."),
        "original_max_position": _read(rs, "original_max_position_embeddings", int, problems, within="rope_scaling."),
    }


def _llama(c: dict, kind: str, seq: int | None, problems: list[str]) -> dict:
    missing: list[str] = []  # keys the rest needs: with any of them wrong there is nothing to check
    hidden, heads = _read(c, "hidden_size", int, missing), _read(c, "num_attention_heads", int, missing)
    out = {
        "arch": "llama",
        "layers": _read(c, "num_hidden_layers", int, missing),
        "hidden": hidden,
        "heads": heads,
        # absent from configs of multi-head models: one KV head per query head
        "kv_heads": _read(c, "num_key_value_heads", int, missing, heads),
        "ffn": _read(c, "intermediate_size", int, missing),
        "vocab": _read(c, "vocab_size", int, missing),
        # the longest context, unless the caller gives the training sequence (presets.py says why)
        "seq": seq or _read(c, "max_position_embeddings", int, missing),
        "norm_eps": _read(c, "rms_norm_eps", float, missing, 1e-6),
        "rope_theta": _read(c, "rope_theta", float, missing, 10000.0),
        "rope_scaling": _rope_scaling(c, problems),
        "tie_embeddings": _read(c, "tie_word_embeddings", bool, missing, False),
        "qkv_bias": kind == "qwen2",  # Qwen2Attention: bias on q_proj, k_proj, v_proj only
    }
    if kind == "mixtral":
        out["experts"] = _read(c, "num_local_experts", int, missing)
        out["top_k"] = _read(c, "num_experts_per_tok", int, missing)
    if missing:
        problems += missing
        return {}
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r}: the llama family's SwiGLU uses 'silu'")
    head_dim = _read(c, "head_dim", int, problems, None)
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
    # Qwen2's configs carry a window that use_sliding_window leaves off
    if kind == "qwen2":
        window = window if c.get("use_sliding_window") else None
    if window is not None and window < out["seq"]:
        if kind == "mistral":  # every layer local (window_pattern 0), as MistralAttention masks each one
            out["sliding_window"] = _read(c, "sliding_window", int, problems)
        else:  # Qwen2's sliding layers start at max_window_layers: not this pattern
            problems.append(
                f"sliding_window={window} < seq={out['seq']}: {kind}'s sliding-window layers are not built; "
                "pass seq <= sliding_window (the window then changes nothing)"
            )
    if kind == "mixtral" and c.get("router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={c['router_jitter_noise']}: the router is deterministic here")
    return out


def _gpt2(c: dict, seq: int | None, problems: list[str]) -> dict:
    missing: list[str] = []
    hidden = _read(c, "n_embd", int, missing)
    out = {
        "arch": "gpt2",
        "layers": _read(c, "n_layer", int, missing),
        "hidden": hidden,
        "heads": _read(c, "n_head", int, missing),
        # GPT-2's n_inner is null: 4·n_embd, as transformers' GPT2MLP takes it
        "ffn": _read(c, "n_inner", int, missing, None) or 4 * (hidden or 0),
        "vocab": _read(c, "vocab_size", int, missing),
        "seq": seq or _read(c, "n_positions", int, missing),
        "norm_eps": _read(c, "layer_norm_epsilon", float, missing, 1e-5),
        "tie_embeddings": _read(c, "tie_word_embeddings", bool, missing, True),
    }
    if missing:
        problems += missing
        return {}
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


def _yarn(c: dict, problems: list[str]) -> tuple[float | None, dict | None]:
    """(rope_theta, YarnRope fields or None) of a DeepSeek-V3 config: transformers 5 writes
    rope_parameters (rope_theta inside), the released config.json rope_scaling {"type": "yarn"} and
    a top-level rope_theta."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = _read(rp, "rope_theta", float, problems, None, "rope_parameters.") or _read(
        c, "rope_theta", float, problems, 10000.0
    )
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        problems.append(f"rope type {kind!r}: DeepSeek-V3 is built with plain RoPE or YaRN ('yarn') only")
        return theta, None
    return theta, yarn_fields(rp, problems)


def _deepseek_v3(c: dict, seq: int | None, problems: list[str]) -> dict:
    """DeepseekV3ForCausalLM (transformers models/deepseek_v3): MLA with YaRN, the first
    first_k_dense_replace layers dense, the rest DeepSeek-V3's MoE (hf/moe.py: sigmoid router with
    the aux-loss-free bias, shared experts, group-limited routing); the multi-token-prediction layer
    (num_nextn_predict_layers) is left out, as transformers leaves it out of DeepseekV3ForCausalLM
    (its weights are skipped on load)."""
    missing: list[str] = []
    layers = _read(c, "num_hidden_layers", int, missing)
    out = {
        "arch": "deepseek_v3",
        "layers": layers,
        "hidden": _read(c, "hidden_size", int, missing),
        "heads": _read(c, "num_attention_heads", int, missing),
        "ffn": _read(c, "intermediate_size", int, missing),
        "vocab": _read(c, "vocab_size", int, missing),
        "seq": seq or _read(c, "max_position_embeddings", int, missing),
        "norm_eps": _read(c, "rms_norm_eps", float, missing, 1e-6),
        "tie_embeddings": _read(c, "tie_word_embeddings", bool, missing, False),
        # transformers' q_lora_rank null: queries projected directly (DeepSeek-V2-Lite)
        "q_lora_rank": _read(c, "q_lora_rank", int, missing, None),
        "kv_lora_rank": _read(c, "kv_lora_rank", int, missing),
        "qk_nope_head_dim": _read(c, "qk_nope_head_dim", int, missing),
        "qk_rope_head_dim": _read(c, "qk_rope_head_dim", int, missing),
        "v_head_dim": _read(c, "v_head_dim", int, missing),
    }
    out["rope_theta"], out["yarn"] = _yarn(c, missing)
    if missing:
        problems += missing
        return {}
    # the MoE layers from first_k_dense_replace on (labkit/config/hf/moe.py); all dense when it covers
    # every layer or there are no routed experts
    dense = _read(c, "first_k_dense_replace", int, problems, 3)
    if (_read(c, "n_routed_experts", int, problems, 0) or 0) and dense is not None and dense < layers:
        moe, found = moe_fields(c, DEEPSEEK_V3)
        problems += found
        out.update(moe)
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r}: DeepSeek-V3's SwiGLU uses 'silu'")
    if c.get("attention_bias"):
        problems.append("attention_bias=True: MLA's projections have no biases in labkit")
    if c.get("rope_interleave", True) is not True:
        problems.append("rope_interleave=False: labkit rotates DeepSeek's interleaved pairs (its released layout)")
    kv = c.get("num_key_value_heads")
    if kv is not None and kv != out["heads"]:
        problems.append(f"num_key_value_heads={kv}: MLA has a key and value per head (= num_attention_heads)")
    return out


def hf_fields(config, seq: int | None = None) -> tuple[dict, list[str]]:
    """(ModelConfig keyword arguments, problems) of a Hugging Face config (dict or path); ConfigError
    for what is not a config at all."""
    c = load(config)
    kind = family_of(c)  # Qwen3, SmolLM3, Gemma 3 (labkit/config/hf/families.py)
    cls = kind or _arch_class(c)
    if cls is None:
        known = ", ".join([*LLAMA_LIKE, GPT2, DEEPSEEK_V3, *FAMILIES])
        return {}, [
            f"architectures={c.get('architectures')!r} (model_type={c.get('model_type')!r}): supported: {known}"
        ]
    problems: list[str] = []
    if kind:
        fields = read_family(c, kind, seq, _read, problems)
        if fields and kind == "qwen3_moe":  # Qwen3's attention, then its experts
            moe, found = moe_fields(c, QWEN3_MOE)
            problems += found
            fields.update(moe)
    elif cls == DEEPSEEK_V3:
        fields = _deepseek_v3(c, seq, problems)
    else:
        fields = _gpt2(c, seq, problems) if cls == GPT2 else _llama(c, LLAMA_LIKE[cls], seq, problems)
    if not fields:  # a key it needs is missing or mistyped: problems names it
        return fields, problems
    # a value that is the family's default stays unset (None), as in a config written by hand
    if fields.get("kv_heads") == fields["heads"]:
        fields["kv_heads"] = None
    if fields["tie_embeddings"] == family(fields["arch"]).ties:
        fields["tie_embeddings"] = None
    return fields, problems
