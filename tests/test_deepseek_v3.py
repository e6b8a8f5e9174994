"""DeepSeek-V3 whole (issue 35): MLA (tests/test_mla.py) joined with its MoE layers (tests/test_moe_fine.py)
in ModelConfig.from_hf: the published config counted like transformers' DeepseekV3ForCausalLM on the meta
device, and a small config's logits equal transformers' on the same weights, the aux-loss-free bias and the
group limit biting."""

from __future__ import annotations

import pytest
import torch
from test_mla import DEEPSEEK_V3, SMALL, hf_config

from labkit import ConfigError, ModelConfig
from labkit.engines.model import build_model

T = pytest.importorskip("transformers")

MOE = dict(
    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=1, n_group=4,
    topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, num_hidden_layers=3,
)  # fmt: skip
"""A small DeepSeek-V3: one dense block, then two MoE blocks of 8 routed experts (top-3 within 2 of 4 groups)
and a shared one."""


def test_the_published_model_counts_as_transformers():
    with torch.device("meta"):
        hf = T.DeepseekV3ForCausalLM(hf_config(DEEPSEEK_V3))
    m = ModelConfig.from_hf(DEEPSEEK_V3, seq=4096)
    assert (m.experts, m.top_k, m.moe_ffn, m.shared_experts, m.n_group, m.topk_group, m.dense_layers) == (
        256, 8, 2048, 1, 8, 4, 3,
    )  # fmt: skip
    assert m.sigmoid_router and m.routed_scaling_factor == 2.5
    assert m.num_params() == sum(p.numel() for p in hf.parameters()) == 671_026_404_352


ATTENTION = {
    "wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
    "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj",
}  # fmt: skip
"""labkit's MLA weights -> transformers' (as tests/test_mla.py maps them)."""
SWIGLU = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


def _weights(net, cfg) -> dict:
    """transformers' names for labkit's DeepSeek-V3 weights: MLA's, the dense blocks' MLPs, and each MoE
    block's router, bias, fused experts and shared expert."""
    sd = {"model.embed_tokens.weight": net.embed.tok.weight, "model.norm.weight": net.head.norm.weight}
    sd["lm_head.weight"] = net.head.proj.weight
    for i, b in enumerate(net.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = b.ln1.weight, b.ln2.weight
        for ours, theirs in ATTENTION.items():
            if hasattr(b.attn, ours):
                sd[p + f"self_attn.{theirs}.weight"] = getattr(b.attn, ours).weight
        if i < cfg.dense_layers:
            for ours, theirs in SWIGLU:
                sd[p + f"mlp.{theirs}.weight"] = getattr(b.mlp, ours).weight
            continue
        moe = b.mlp
        sd[p + "mlp.gate.weight"] = moe.router.weight
        sd[p + "mlp.gate.e_score_correction_bias"] = moe.expert_bias
        # transformers 5.24 fuses the experts: gate_up_proj (E, 2f, h), down_proj (E, h, f)
        sd[p + "mlp.experts.gate_up_proj"] = torch.cat([moe.w1, moe.w3], dim=2).transpose(1, 2)
        sd[p + "mlp.experts.down_proj"] = moe.w2.transpose(1, 2)
        for ours, theirs in SWIGLU:
            sd[p + f"mlp.shared_experts.{theirs}.weight"] = getattr(moe.shared, ours).weight
    return sd


def test_logits_equal_transformers():
    from test_hf_numerics import logits

    c = {**DEEPSEEK_V3, **SMALL, **MOE, "rope_scaling": None}
    cfg = ModelConfig.from_hf(c, seq=32)
    assert cfg.dense_layers == 1 and cfg.moe_layers == 2
    net = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():  # off 1 (the norms), so that every weight matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for b in net.blocks[cfg.dense_layers :]:  # a bias that changes the choice
            b.mlp.expert_bias.copy_(torch.randn(cfg.experts, generator=gen) * 0.3)
    config = hf_config(c)
    config._attn_implementation = "eager"
    hf = T.DeepseekV3ForCausalLM(config).eval()
    state = {k: v.detach().clone() for k, v in _weights(net, cfg).items()}
    missing, unexpected = hf.load_state_dict(state)
    assert not missing and not unexpected, (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab, (2, 32), generator=gen)
    with torch.no_grad():
        ours, theirs = logits(net, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    # the check can fail: zeroing the bias changes the experts chosen, and the logits past the bound
    with torch.no_grad():
        for b in net.blocks[cfg.dense_layers :]:
            b.mlp.expert_bias.zero_()
        moved = logits(net, tokens)
    assert (moved - theirs).abs().max() > 1e-3 * theirs.abs().max()


def test_an_unbuilt_router_is_refused_by_name():
    with pytest.raises(ConfigError, match="topk_method='greedy'"):
        ModelConfig.from_hf({**DEEPSEEK_V3, "topk_method": "greedy"}, seq=4096)
