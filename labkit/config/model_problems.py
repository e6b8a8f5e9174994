"""Validation of the model itself: what its family and attention allow under a layout (how tp
may split the KV heads, RoPE, biases, the loss), and how its blocks split over pipeline stages.
labkit/config/validation.py asks these with the rest (each field alone is checked there when its
config is built); plain Python, the ladder's bottom rung beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.config.latent import latent_problems
from labkit.config.norms import norm_kind

if TYPE_CHECKING:
    from labkit.config import ModelConfig, ParallelConfig


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def suggest(values: list[int]) -> str:
    values = sorted(set(values))
    if not values:
        return ""
    if len(values) == 1:
        return f"try {values[0]}"
    return "try " + ", ".join(str(v) for v in values[:-1]) + f" or {values[-1]}"


def family_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """What the model family (arch) and its attention allow, and how tp may split its KV heads."""
    out = []
    kv = model.n_kv_heads
    if model.heads % kv:
        return [f"kv_heads={model.kv_heads!r} must divide heads={model.heads}; {suggest(divisors(model.heads))}"]
    if model.heads % cfg.tp or kv == model.heads:
        pass  # the heads check says it (kv_heads = heads: the same split)
    elif cfg.tp > kv and cfg.tp % kv:
        out.append(
            f"tp={cfg.tp} > kv_heads={kv} replicates each KV head on tp/kv_heads ranks, so kv_heads must "
            f"divide tp; {suggest([t for t in divisors(model.heads) if t <= kv or t % kv == 0])} for tp"
        )
    elif kv % cfg.tp and cfg.tp < kv:
        out.append(f"kv_heads={kv} is not divisible by tp={cfg.tp}; {suggest(divisors(kv))} for tp")
    if cfg.torch_impl and cfg.tp > kv:
        out.append(
            f"impl='torch' with tp={cfg.tp} > kv_heads={kv}: DTensor's ColwiseParallel splits wk and wv by "
            "rows and cannot replicate a KV head (torchtitan requires kv_heads % tp == 0); use impl='lab' "
            f"or tp <= {kv}"
        )
    if model.family.rotary and not model.family.latent_attention and model.head_dim % 2:
        out.append(f"head_dim={model.head_dim} must be even for rotary embeddings (pairs of dimensions rotate)")
    if not model.family.rotary and (model.rope_scaling is not None or model.rope_theta != 10000.0):
        out.append(f"rope_theta / rope_scaling apply to arch='llama' only (arch={model.arch!r} learns its positions)")
    out += _attention_variant_problems(cfg, model)
    if not model.family.takes_qkv_bias and model.qkv_bias:
        out.append(
            f"qkv_bias applies to arch='llama' (Qwen2); arch={model.arch!r} has "
            + ("a bias on every projection already" if model.family.biases else "no biases")
        )
    fam = model.family
    if (fam.latent_attention or fam.offset_norm or fam.sinks) and model.norms != norm_kind(model.arch, "default"):
        out.append(
            f"norm={model.norm!r} on arch={model.arch!r}: its norms are the family's own (DeepSeek-V3's RMSNorm beside "
            "its latent norms, Gemma 3's (1 + w) RMSNorm, GPT-OSS's RMSNorm); leave norm='default', or use gpt, gpt2 "
            "or llama, whose norms may be any"
        )
    out += latent_problems(cfg, model)  # MLA's fields (arch='deepseek_v3')
    out += _sink_problems(cfg, model)
    if model.fused_loss and cfg.torch_impl and cfg.tp > 1:
        out.append(
            "loss='fused' with impl='torch' and tp > 1: DTensor's loss_parallel takes F.cross_entropy only; "
            "use impl='lab' (its vocab-parallel loss has both ways) or loss='fp32'"
        )
    return out


def _attention_variant_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """The fields of Qwen3, SmolLM3 and Gemma 3: what they need of the family and the layout."""
    out = []
    rope_fields = model.nope_interval or model.rope_local_theta is not None or model.rope_linear_factor != 1.0
    if rope_fields and not model.family.rotary:
        out.append(
            f"nope_interval / rope_local_theta / rope_linear_factor apply to a rotary family (arch={model.arch!r} "
            "learns its positions); use arch='llama' or 'gemma3'"
        )
    if model.sliding_window is None and (model.window_pattern or model.rope_local_theta is not None):
        out.append("window_pattern / rope_local_theta describe sliding-window layers: set sliding_window too")
    variant = model.qk_norm or model.kv_channels is not None or model.family.sandwich_norm
    if cfg.torch_impl and cfg.tp > 1 and variant:
        # DTensor's plan (engines/parallel/tensor/dtensor.py) has no entries for these: q_norm / k_norm's
        # gradients would stay partial per tp rank (transformers' plan calls them 'replicated_with_grad_allreduce')
        out.append(
            "impl='torch' with tp > 1 on a model with qk_norm, kv_channels or Gemma's norms: the DTensor plan "
            "does not split them; use impl='lab'"
        )
    return out


def _sink_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """GPT-OSS (arch='gpt_oss'): the strategies not built for its sinks and biases, refused with the reason."""
    if not model.family.sinks:
        return []
    out = []
    if cfg.tp > 1 and cfg.torch_impl:
        out.append(
            f"impl='torch' with tp={cfg.tp} and arch='gpt_oss': the DTensor plan has no row for the sinks; "
            "use impl='lab' (the sinks split by heads with wq's rows)"
        )
    if cfg.cp > 1 and not (cfg.context.ring and not cfg.context.hierarchical):
        out.append(
            f"cp_kind={cfg.cp_kind!r} with arch='gpt_oss': the sinks join the ring's merged log-sum-exp only "
            "(engines/parallel/context/); use cp_kind='ring'"
        )
    return out


def stage_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """How the blocks split over pp * virtual_stages pipeline stages: evenly, or as stage_layers says."""
    chunks = cfg.pp * cfg.virtual_stages
    if cfg.stage_layers:
        sl = cfg.stage_layers
        out = []
        if len(sl) != chunks:
            out.append(
                f"stage_layers has {len(sl)} entries, but pp({cfg.pp}) * virtual_stages({cfg.virtual_stages}) "
                f"= {chunks} stages; give one count per stage"
            )
        if sum(sl) != model.layers:
            out.append(f"stage_layers={sl} sums to {sum(sl)}, but the model has layers={model.layers}")
        return out
    if model.layers % chunks:
        fits = [p for p in divisors(model.layers) if p * cfg.virtual_stages <= model.layers]
        base, extra = divmod(model.layers, chunks)
        even = (base + 1,) * extra + (base,) * (chunks - extra)
        return [
            f"layers={model.layers} cannot be split into pp({cfg.pp}) * virtual_stages("
            f"{cfg.virtual_stages}) = {chunks} equal chunks; {suggest(fits)} for pp, or uneven stages: "
            f"stage_layers={even}"
        ]
    return []
