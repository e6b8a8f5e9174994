"""GptOssForCausalLM's config.json -> ModelConfig fields (hf/families.py dispatches here).

Read as transformers 5.24 builds the model (models/gpt_oss/configuration_gpt_oss.py, modeling_gpt_oss.py),
in both spellings a config comes in: as OpenAI published it (openai/gpt-oss-20b and -120b config.json:
rope_theta and rope_scaling) and as transformers >= 5 writes it (rope_parameters). What it reads:

    arch 'gpt_oss'      biased q, k, v, o with a sink per head; RMSNorm; MoE in every block (router and
                        experts biased, softmax over the top-k logits, the clamped SwiGLU)
    kv_channels         head_dim 64, apart from hidden / heads (2880 / 64 = 45)
    sliding_window      128 on the layers layer_types calls sliding: every other one, the first local
                        (window_pattern 2)
    yarn                YaRN over the whole head: factor 32 from 4096 positions, truncate=false, and
                        cos/sin times mscale(32) = 1.3466 (no mscale pair in the config)

The mxfp4 `quantization_config` of the released checkpoints is how the weights are stored, not the
architecture: labkit trains in its own precision and ignores it. router_aux_loss_coef is training's choice
(aux_loss_coef), not read. Anything else that would change the model is refused by name.
"""

from __future__ import annotations

from labkit.config.hf.keys import _read, yarn_fields

GPT_OSS = "GptOssForCausalLM"


def _yarn(c: dict, problems: list[str]) -> tuple[float | None, dict | None]:
    """(rope_theta, YarnRope fields) from rope_parameters (transformers 5) or rope_scaling + rope_theta."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = _read(rp, "rope_theta", float, problems, None, "rope_parameters.") or _read(
        c,
        "rope_theta",
        float,
        problems,
        150000.0,  # GptOssConfig.default_theta
    )
    kind = rp.get("rope_type", rp.get("type", "yarn" if not rp else "default"))
    if not rp:  # GptOssConfig's own default rope_parameters
        return theta, {"factor": 32.0, "original_max_position": 4096, "mscale": 0.0, "mscale_all_dim": 0.0,
                       "truncate": False}  # fmt: skip
    if kind != "yarn":
        problems.append(f"rope type {kind!r}: GPT-OSS is built with YaRN ('yarn') only here")
        return theta, None
    # GPT-OSS keeps YaRN's ramp ends unrounded when its config says truncate: false
    return theta, {
        **yarn_fields(rp, problems),
        "truncate": _read(rp, "truncate", bool, problems, True, "rope_scaling."),
    }


def read_gpt_oss(c: dict, seq: int | None, problems: list[str]) -> dict:
    """ModelConfig fields of a GptOssForCausalLM config, {} with `problems` naming a missing key."""
    missing: list[str] = []
    heads = _read(c, "num_attention_heads", int, missing)
    out = {
        "arch": "gpt_oss",
        "layers": _read(c, "num_hidden_layers", int, missing),
        "hidden": _read(c, "hidden_size", int, missing),
        "heads": heads,
        "kv_heads": _read(c, "num_key_value_heads", int, missing, heads),
        "ffn": _read(c, "intermediate_size", int, missing),
        "vocab": _read(c, "vocab_size", int, missing, 201088),
        "seq": seq or _read(c, "max_position_embeddings", int, missing, 131072),
        "norm_eps": _read(c, "rms_norm_eps", float, missing, 1e-5),
        "tie_embeddings": _read(c, "tie_word_embeddings", bool, missing, False),
        # transformers 5 writes num_local_experts; "experts_per_token" is OpenAI's own spelling beside it
        "experts": _read(c, "num_local_experts", int, missing, 128),
        "top_k": _read(c, "num_experts_per_tok", int, missing, 4),
    }
    out["rope_theta"], out["yarn"] = _yarn(c, missing)
    if missing:
        problems += missing
        return {}
    hd = _read(c, "head_dim", int, problems, 64)
    if hd is not None and hd != out["hidden"] // out["heads"]:
        out["kv_channels"] = hd
    window = _read(c, "sliding_window", int, problems, 128)
    n = out["layers"]
    expected = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = c.get("layer_types")
    if window is None:  # every layer full: transformers then masks nothing on the "sliding" ones
        if types is not None and "sliding_attention" in types:
            problems.append("sliding_window=null with sliding layers in layer_types: give the window (GPT-OSS: 128)")
    else:
        out["sliding_window"], out["window_pattern"] = window, 2
        if types is not None and list(types) != expected:
            problems.append(
                f"layer_types={types!r}: labkit builds GPT-OSS's alternation, sliding then full ({expected[:4]}...)"
            )
    for key, want in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        got = _read(c, key, float, problems, want)
        if got is not None and got != want:
            problems.append(f"{key}={got}: GPT-OSS's clamped SwiGLU is built with {key}={want} (engines/moe.py)")
    if c.get("attention_bias", True) is not True:
        problems.append("attention_bias=False: GPT-OSS's q, k, v and o carry biases in labkit's build")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r}: GPT-OSS's experts use the clamped SwiGLU ('silu')")
    return out
