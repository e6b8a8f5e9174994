"""torchtitan's model registry -> labkit's ModelConfig: `[model] name` and `flavor` of a job
(labkit/config/jobs/torchtitan/).

Transcribed from torchtitan 0.3.0 (the PyPI wheel, sha256 5563ccf9...af42, whose torchtitan/models/ is
branch release/0.3 at commit 4f9e9a47d49dfbcac960857dd67748c67aecd2e5): each family's `*_configs`
dict in torchtitan/models/<name>/__init__.py, every flavor (the debug ones too), each one the same
number of parameters as torchtitan's own model built on the meta device (tests/test_torchtitan.py).

    llama3       debugmodel 1B 3B 8B 70B 405B                      llama3_configs
    qwen3        debugmodel debugmodel_non_fused_qkv 0.6B 1.7B 4B 8B 14B 32B
                 debugmodel_moe 30B-A3B 235B-A22B                   qwen3_configs
    deepseek_v3  debugmodel 16B 236B 671B                           deepseekv3_configs (MTP off: num_mtp_layers=0)
    gpt_oss      debugmodel 20b 120b                                gptoss_configs

Refused by name (labkit does not build them): qwen3_5 (Gated DeltaNet linear-attention layers),
kimi_k2_7 (a vision tower beside DeepSeek-V3's text model), flux (a diffusion model), muse_glimmer
(its vision adapter). Where torchtitan's module differs from labkit's without changing a count, the
flavor's note says so (Job.notes).
"""

from __future__ import annotations

from labkit.config import ModelConfig, RopeScaling
from labkit.config.choices import ConfigError
from labkit.config.latent import YarnRope

LLAMA3 = {
    # flavor: (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of, vocab_size, tied)
    "debugmodel": (256, 6, 16, None, None, 256, 2048, False),
    "1B": (2048, 16, 32, 8, 1.5, 1024, 128256, True),
    "3B": (3072, 28, 24, 8, 1.0, 1024, 128256, True),
    "8B": (4096, 32, 32, 8, 1.3, 1024, 128256, False),
    "70B": (8192, 80, 64, 8, 1.3, 4096, 128256, False),
    "405B": (16384, 126, 128, 8, 1.2, 4096, 128256, False),
}
QWEN3 = {
    # flavor: (dim, n_layers, n_heads, n_kv_heads, hidden_dim or moe_hidden_dim, vocab, tied, experts, top_k, theta)
    "debugmodel": (256, 8, 16, 8, 3072, 2048, True, 0, 1, 1e6),
    "debugmodel_non_fused_qkv": (256, 8, 16, 8, 3072, 2048, True, 0, 1, 1e6),
    "0.6B": (1024, 28, 16, 8, 3072, 151936, True, 0, 1, 1e6),
    "1.7B": (2048, 28, 16, 8, 6144, 151936, True, 0, 1, 1e6),
    "4B": (2560, 36, 32, 8, 9728, 151936, True, 0, 1, 1e6),
    "8B": (4096, 36, 32, 8, 12288, 151936, False, 0, 1, 1e6),
    "14B": (5120, 40, 40, 8, 17408, 151936, False, 0, 1, 1e6),
    "32B": (5120, 64, 64, 8, 25600, 151936, False, 0, 1, 1e6),
    "debugmodel_moe": (256, 8, 16, 8, 768, 2048, False, 64, 8, 1e6),
    "30B-A3B": (2048, 48, 32, 4, 768, 151936, False, 128, 8, 1e6),
    "235B-A22B": (4096, 94, 64, 4, 1536, 151936, False, 128, 8, 5e6),
}
QWEN3_HEAD_DIM = 128
"""Every Qwen3 flavor's head_dim (the q/k norms are this wide)."""
DEEPSEEK_V3 = {
    # flavor: (dim, n_layers, vocab, n_heads, q_lora_rank, mscale, dense_hidden, moe_hidden, experts, shared,
    #          top_k, score_func, groups, limited_groups, route_scale, route_norm, n_dense_layers)
    "debugmodel": (256, 6, 2048, 16, 0, 0.70, 1024, 256, 8, 2, 3, "softmax", None, None, 1.0, False, 1),
    "16B": (2048, 27, 102400, 16, 0, 0.70, 10944, 1408, 64, 2, 6, "softmax", None, None, 1.0, False, 1),
    "236B": (5120, 60, 102400, 128, 1536, 1.0, 12288, 1536, 160, 2, 6, "softmax", 8, 3, 16.0, False, 1),
    "671B": (7168, 61, 129280, 128, 1536, 1.0, 18432, 2048, 256, 1, 8, "sigmoid", 8, 4, 2.5, True, 3),
}
GPT_OSS = {"debugmodel": (256, 4, 2048, 8), "20b": (2880, 24, 201088, 32), "120b": (2880, 36, 201088, 128)}
"""flavor: (dim, n_layers, vocab_size, num_experts); all with hidden_dim 2880, top-4, 64 heads of 64,
8 KV heads, a 128-token window on the even layers, YaRN x32 from 4096 (truncate=False), theta 150000."""
MOE_BIAS = 1e-3
"""torchtitan's MoE load_balance_coeff (models/common/moe.py): its expert bias's update speed."""
NOT_BUILT = {
    "qwen3_5": "its Gated DeltaNet linear-attention layers are not built",
    "kimi_k2_7": "its vision tower is not built (the text model is DeepSeek-V3's: name = 'deepseek_v3')",
    "flux": "a diffusion model, not a decoder-only language model",
    "muse_glimmer": "its vision adapter and attention layout are not built",
}


def ffn_width(dim: int, multiplier: float | None, multiple_of: int) -> int:
    """torchtitan's compute_ffn_hidden_dim (models/common/feed_forward.py): 2/3 of 4*dim, times the
    multiplier, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _llama3(flavor: str, seq: int) -> tuple[ModelConfig, list[str]]:
    dim, layers, heads, kv, mult, multiple_of, vocab, tied = LLAMA3[flavor]
    model = ModelConfig(
        arch="llama", layers=layers, hidden=dim, heads=heads, kv_heads=kv, ffn=ffn_width(dim, mult, multiple_of),
        vocab=vocab, seq=seq, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True if tied else None,
        # ComplexRoPE scaling='llama' at its defaults (factor 8, low 1, high 4, 8192), every flavor
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192),
    )  # fmt: skip
    return model, []


def _qwen3(flavor: str, seq: int) -> tuple[ModelConfig, list[str]]:
    dim, layers, heads, kv, hidden, vocab, tied, experts, top_k, theta = QWEN3[flavor]
    moe = {"experts": experts, "top_k": top_k, "aux_loss_coef": 0.0} if experts else {}
    model = ModelConfig(
        arch="llama", layers=layers, hidden=dim, heads=heads, kv_heads=kv, ffn=hidden, vocab=vocab, seq=seq,
        rope_theta=theta, norm_eps=1e-6, qk_norm=True, tie_embeddings=True if tied else None,
        kv_channels=None if dim // heads == QWEN3_HEAD_DIM else QWEN3_HEAD_DIM, **moe,
    )  # fmt: skip
    notes = [_bias_note(flavor)] if experts else []
    return model, notes


def _bias_note(flavor: str) -> str:
    return (
        f"flavor {flavor!r}: torchtitan's MoE moves an expert bias with its softmax router too "
        f"(load_balance_coeff {MOE_BIAS}); labkit's bias runs with the sigmoid router only, so this job's has none"
    )


def _deepseek_v3(flavor: str, seq: int) -> tuple[ModelConfig, list[str]]:
    (dim, layers, vocab, heads, q_lora, mscale, dense, moe, experts, shared,
     top_k, score, groups, limited, scale, norm, n_dense) = DEEPSEEK_V3[flavor]  # fmt: skip
    sigmoid = score == "sigmoid"
    model = ModelConfig(
        arch="deepseek_v3", layers=layers, hidden=dim, heads=heads, ffn=dense, vocab=vocab, seq=seq,
        norm_eps=1e-5,  # torchtitan's RMSNorm default (DeepSeek's own checkpoints: 1e-6)
        q_lora_rank=q_lora or None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        # torchtitan scales the softmax by mscale(40, mscale)^2 (max_seq_len 16384 > 4096), as DeepSeek's inference
        yarn=YarnRope(factor=40.0, original_max_position=4096, mscale=mscale, mscale_all_dim=mscale),
        experts=experts, top_k=top_k, moe_ffn=moe, shared_experts=shared, norm_topk_prob=norm,
        router="sigmoid" if sigmoid else "softmax", n_group=groups or 1, topk_group=limited or 1,
        routed_scaling_factor=scale, dense_layers=n_dense, aux_loss_coef=0.0,
        bias_update_speed=MOE_BIAS if sigmoid else 0.0,
    )  # fmt: skip
    return model, [] if sigmoid else [_bias_note(flavor)]


def _gpt_oss(flavor: str, seq: int) -> tuple[ModelConfig, list[str]]:
    dim, layers, vocab, experts = GPT_OSS[flavor]
    model = ModelConfig(
        arch="gpt_oss", layers=layers, hidden=dim, heads=64, kv_heads=8, kv_channels=64, ffn=2880, vocab=vocab,
        seq=seq, experts=experts, top_k=4, rope_theta=150000.0, sliding_window=128, window_pattern=2,
        yarn=YarnRope(factor=32.0, original_max_position=4096, mscale=0.0, mscale_all_dim=0.0, truncate=False),
        aux_loss_coef=0.0,
    )  # fmt: skip
    return model, [_bias_note(flavor)]


FAMILIES = {"llama3": (LLAMA3, _llama3), "qwen3": (QWEN3, _qwen3), "deepseek_v3": (DEEPSEEK_V3, _deepseek_v3),
            "gpt_oss": (GPT_OSS, _gpt_oss)}  # fmt: skip


def flavor_model(name: str, flavor: str, seq: int) -> tuple[ModelConfig, list[str]]:
    """(the model of torchtitan's `name` / `flavor` at sequence length `seq`, notes)."""
    if name in NOT_BUILT:
        raise ConfigError([f"[model] name = {name!r}: torchtitan registers it, but {NOT_BUILT[name]}"])
    if name not in FAMILIES:
        raise ConfigError([f"[model] name = {name!r} is not a torchtitan model labkit reads: {sorted(FAMILIES)}"])
    table, build = FAMILIES[name]
    if flavor not in table:
        raise ConfigError([f"[model] name = {name!r}, flavor = {flavor!r}: torchtitan 0.3.0 has {list(table)}"])
    return build(flavor, seq)
