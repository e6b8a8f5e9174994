"""Multi-head latent attention's part of the config (arch 'deepseek_v3'): its YaRN RoPE
(`YarnRope`), its weights' shapes (`mla_shapes`, read by ModelConfig.num_params and the theory's
param_shapes alike) and the rules its fields obey (`latent_problems`).

MLA (DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3, arXiv 2412.19437, section 2.1.1):
keys and values come from one low-rank latent c_kv = W_DKV x of width kv_lora_rank (eq. 1 of V3),
normalised and up-projected per head (k_nope, v = W_UK c_kv, W_UV c_kv); a separate, shared
rotary key k_pe = RoPE(W_KR x) of width qk_rope_head_dim (eq. 3) is appended to every head's
key; queries likewise from a latent c_q of width q_lora_rank (eqs. 6-9; 0: projected directly,
as DeepSeek-V2-Lite). Module names are those of DeepSeek's own inference/model.py (wq_a, q_norm,
wq_b, wkv_a, kv_norm, wkv_b, wo); transformers' are q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (models/deepseek_v3/modeling_deepseek_v3.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from labkit.config.base import _Dict
from labkit.config.choices import ConfigError

if TYPE_CHECKING:
    from labkit.config import ModelConfig, ParallelConfig

LATENT_NORM_EPS = 1e-6
"""Epsilon of q_norm and kv_norm: fixed, not rms_norm_eps (DeepSeek-V3 inference/model.py builds
them as RMSNorm(rank) with its default 1e-6; transformers' DeepseekV3RMSNorm(q_lora_rank) the same)."""


@dataclass(frozen=True)
class YarnRope(_Dict):
    """YaRN (Peng et al. 2023, arXiv 2309.00071) as DeepSeek-V3 uses it (config.json's rope_scaling,
    type 'yarn'): frequencies with wavelengths beyond original_max_position / (2π beta_slow)
    rotations divided by `factor`, those under beta_fast rotations kept, a linear ramp between;
    softmax scale multiplied by mscale(factor, mscale_all_dim)^2 and cos/sin by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale(f, m) = 0.1 m ln f + 1
    (transformers modeling_rope_utils.py `_compute_yarn_parameters`, modeling_deepseek_v3.py
    `yarn_apply_mscale`). transformers applies it at every length, and so does labkit; DeepSeek's
    inference/model.py only when max_seq_len > original_seq_len (give yarn=None to train short)."""

    factor: float = 40.0
    original_max_position: int = 4096
    """The pre-training context (HF original_max_position_embeddings; DeepSeek original_seq_len)."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True
    """Round the correction range's ends to whole dimensions (floor, ceil), as DeepSeek-V3 does;
    GPT-OSS's config says truncate=false (transformers `find_correction_range`)."""

    def __post_init__(self):
        bad = [
            f"yarn.{k}={getattr(self, k)!r} must be > 0"
            for k in ("factor", "beta_fast", "beta_slow")
            if not getattr(self, k) > 0
        ]
        if not self.original_max_position >= 1:
            bad.append(f"yarn.original_max_position={self.original_max_position!r} must be >= 1")
        if bad:
            raise ConfigError(bad)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """0.1 m ln(factor) + 1, or 1 when factor <= 1 (DeepSeek-V3 inference/model.py; transformers `get_mscale`)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_gain(y: YarnRope | None) -> float:
    """YaRN's attention factor on cos and sin (transformers `_compute_yarn_parameters`): mscale(factor,
    mscale) / mscale(factor, mscale_all_dim) when both are set (DeepSeek-V3: 1.0), else mscale(factor)
    (GPT-OSS, which sets neither: 0.1 ln 32 + 1 = 1.3466)."""
    if y is None:
        return 1.0
    if y.mscale and y.mscale_all_dim:
        return yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
    return yarn_mscale(y.factor)


def softmax_scale(m: ModelConfig) -> float:
    """MLA's softmax scale: (qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under
    YaRN (transformers modeling_deepseek_v3.py `yarn_apply_mscale`)."""
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if m.yarn is not None and m.yarn.mscale_all_dim:
        scale *= yarn_mscale(m.yarn.factor, m.yarn.mscale_all_dim) ** 2
    return scale


def mla_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name within the block's attn, shape) of every MLA weight, in registration order (engines/mla.py)."""
    h, nh, r = m.hidden, m.heads, m.kv_lora_rank
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim  # a query's / key's width per head
    out = []
    if m.q_lora_rank:  # queries through their own latent (V3); None: projected directly (V2-Lite)
        out += [("wq_a.weight", (m.q_lora_rank, h)), ("q_norm.weight", (m.q_lora_rank,))]
        out += [("wq_b.weight", (nh * dq, m.q_lora_rank))]
    else:
        out += [("wq.weight", (nh * dq, h))]
    out += [("wkv_a.weight", (r + m.qk_rope_head_dim, h)), ("kv_norm.weight", (r,))]
    out += [("wkv_b.weight", (nh * (m.qk_nope_head_dim + m.v_head_dim), r))]
    out += [("wo.weight", (h, nh * m.v_head_dim))]
    return out


_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def latent_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """What MLA's fields must satisfy, and what is not built with it (named, with the reason)."""
    if not model.family.latent_attention:
        set_ = [f"{k}={getattr(model, k)}" for k in _MLA_FIELDS if getattr(model, k) is not None]
        if model.yarn is not None and not model.family.sinks:  # GPT-OSS rotates its heads with YaRN too
            set_.append("yarn")
        return (
            [
                f"{', '.join(set_)}: multi-head latent attention's fields apply to arch='deepseek_v3' only"
                f"{' (yarn: and gpt_oss)' if model.yarn is not None else ''}"
            ]
            if set_
            else []
        )
    out = []
    for k, least, v3 in (
        ("kv_lora_rank", 1, 512),
        ("qk_rope_head_dim", 2, 64),
        ("v_head_dim", 1, 128),
        ("qk_nope_head_dim", 0, 128),
    ):
        if getattr(model, k) is None or getattr(model, k) < least:
            out.append(f"{k}={getattr(model, k)}: arch='deepseek_v3' needs it >= {least} (DeepSeek-V3: {v3})")
    if out:
        return out
    if model.qk_rope_head_dim % 2:
        out.append(f"qk_rope_head_dim={model.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if model.q_lora_rank is not None and model.q_lora_rank < 1:
        out.append(f"q_lora_rank={model.q_lora_rank} must be >= 1, or None (queries projected directly)")
    if model.kv_heads not in (None, model.heads):
        out.append(
            f"kv_heads={model.kv_heads}: multi-head latent attention up-projects a key and value per query head "
            "(kv_heads = heads); leave kv_heads unset"
        )
    if model.qkv_bias:
        out.append("qkv_bias with arch='deepseek_v3': MLA's projections have no biases (attention_bias=false)")
    if model.rope_scaling is not None:
        out.append("rope_scaling (llama3) with arch='deepseek_v3': DeepSeek-V3 scales its RoPE with YaRN (yarn=...)")
    if cfg.torch_impl and cfg.tp > 1:
        out.append(
            "impl='torch' with tp > 1 and arch='deepseek_v3': labkit's DTensor plan has no MLA rows; "
            "use impl='lab' (heads split, latents replicated)"
        )
    return out
