"""DeepSeek-V3's multi-head latent attention (arch 'deepseek_v3', engines/mla.py): read from its
config.json, counted like transformers' DeepseekV3ForCausalLM (meta device), computing its logits,
and refused where it is not built. The MoE layers are another part: here the model is
all dense (first_k_dense_replace = num_hidden_layers), which transformers builds as such."""

from __future__ import annotations

import pytest
from mla_models import MLA

from labkit import ModelConfig
from labkit.config.choices import ConfigError

T = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# deepseek-ai/DeepSeek-V3's config.json (huggingface.co/deepseek-ai/DeepSeek-V3, the model card's
# repository; the technical report arXiv 2412.19437 section 4.2 gives the same sizes: 61 layers, h 7168,
# 128 heads, d_c 512, d'_c 1536, d_h 128, d_h^R 64; section 4.3 YaRN s = 40, alpha 1, beta 32)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "attention_bias": False,
}
DENSE_V3 = {**DEEPSEEK_V3, "first_k_dense_replace": 61}
"""DeepSeek-V3 with every layer dense: the attention, norms, embeddings and head of the published model."""

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    first_k_dense_replace=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=211,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
)
# original context 16 and 64 positions: YaRN's ramp falls inside the rotary dims (low 0, high 3 of 4)
YARN = {**DEEPSEEK_V3["rope_scaling"], "factor": 4, "original_max_position_embeddings": 16}
CASES = {
    "v3-yarn": ({**DEEPSEEK_V3, **SMALL, "rope_scaling": YARN}, 64),
    # mscale != mscale_all_dim: cos/sin scaled by their ratio, the softmax by mscale_all_dim's square
    "v3-mscale": ({**DEEPSEEK_V3, **SMALL, "rope_scaling": {**YARN, "mscale": 0.707}}, 64),
    # no query latent (DeepSeek-V2-Lite's shape), v wider than q/k, plain RoPE
    "no-q-latent": ({**DEEPSEEK_V3, **SMALL, "q_lora_rank": None, "v_head_dim": 32, "rope_scaling": None}, 32),
}


def hf_config(c: dict):
    return T.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"})


@pytest.mark.parametrize("name, c", [("DeepSeek-V3 all-dense", DENSE_V3), ("small", CASES["v3-yarn"][0])])
def test_count_equals_transformers(name, c):
    with torch.device("meta"):
        hf = T.DeepseekV3ForCausalLM(hf_config(c))
    m = ModelConfig.from_hf(c, seq=4096)
    assert m.num_params() == sum(p.numel() for p in hf.parameters())
    from labkit.theory import num_params

    assert num_params(m) == m.num_params()


def test_published_attention_count():
    """DeepSeek-V3's MLA per layer, by hand from the report's sizes: wq_a 7168·1536, q_norm 1536,
    wq_b 1536·128·192, wkv_a 7168·576, kv_norm 512, wkv_b 512·128·256, wo 16384·7168 = 187,107,328."""
    m = ModelConfig.from_hf(DENSE_V3, seq=4096)
    per_layer = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert per_layer == 187_107_328
    dense_layer = per_layer + 3 * 7168 * 18432 + 2 * 7168
    assert m.num_params() == 61 * dense_layer + 2 * 129280 * 7168 + 7168


def mla_weights(net, cfg) -> dict:
    """transformers' names for labkit's deepseek_v3 weights."""
    sd = {"model.embed_tokens.weight": net.embed.tok.weight, "model.norm.weight": net.head.norm.weight}
    sd["lm_head.weight"] = net.head.proj.weight
    names = {
        "wq": "q_proj",
        "wq_a": "q_a_proj",
        "q_norm": "q_a_layernorm",
        "wq_b": "q_b_proj",
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
    }
    for i, b in enumerate(net.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = b.ln1.weight, b.ln2.weight
        for ours, theirs in names.items():
            if hasattr(b.attn, ours):
                sd[p + f"self_attn.{theirs}.weight"] = getattr(b.attn, ours).weight
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            sd[p + f"mlp.{theirs}.weight"] = getattr(b.mlp, ours).weight
    return sd


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(name):
    from labkit.engines.model import build_model
    from tests.test_hf_numerics import logits

    c, seq = CASES[name]
    cfg = ModelConfig.from_hf(c, seq=seq)
    net = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():  # off 1 (the norms), so that every weight matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    config = hf_config(c)
    config._attn_implementation = "eager"
    hf = T.DeepseekV3ForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in mla_weights(net, cfg).items()})
    assert not missing and not unexpected
    tokens = torch.randint(0, cfg.vocab, (2, seq), generator=gen)
    with torch.no_grad():
        ours, theirs = logits(net, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_a_wrong_rope_changes_the_logits():
    """The check above can fail: the same weights with YaRN's factor changed move the logits past it."""
    from labkit.engines.model import build_model
    from tests.test_hf_numerics import logits

    c, seq = CASES["v3-yarn"]
    cfg = ModelConfig.from_hf(c, seq=seq)
    tokens = torch.randint(0, cfg.vocab, (2, seq), generator=torch.Generator().manual_seed(2))
    a, b = build_model(cfg, 0), build_model(cfg.replace(yarn=cfg.yarn.replace(factor=5.0)), 0)
    with torch.no_grad():
        la, lb = logits(a, tokens), logits(b, tokens)
    assert (la - lb).abs().max() > 1e-5 * la.abs().max()


def test_from_hf_reads_and_refuses_by_name():
    m = ModelConfig.from_hf(DENSE_V3, seq=4096)
    assert (m.arch, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        "deepseek_v3",
        1536,
        512,
        128,
        64,
        128,
    )
    assert m.yarn.factor == 40 and m.yarn.original_max_position == 4096 and m.kv_heads is None
    # transformers 5 writes rope_parameters (rope_theta inside): read the same
    written = hf_config(DENSE_V3).to_dict()
    assert ModelConfig.from_hf({**written, "architectures": ["DeepseekV3ForCausalLM"]}, seq=4096) == m
    # the published model with its MoE layers reads whole: tests/test_families_moe.py
    with pytest.raises(ConfigError, match="rope_interleave=False"):
        ModelConfig.from_hf({**DENSE_V3, "rope_interleave": False}, seq=4096)
    with pytest.raises(ConfigError, match="num_key_value_heads=8"):
        ModelConfig.from_hf({**DENSE_V3, "num_key_value_heads": 8}, seq=4096)
    with pytest.raises(ConfigError, match="longrope"):
        ModelConfig.from_hf({**DENSE_V3, "rope_scaling": {"type": "longrope"}}, seq=4096)


# -- the theory at scale ---------------------------------------------------------------------------
def test_dense_v3_preset_is_what_from_hf_reads():
    from labkit.theory.presets import DEEPSEEK_V3_DENSE

    assert ModelConfig.from_hf(DENSE_V3, seq=4096) == DEEPSEEK_V3_DENSE
    assert DEEPSEEK_V3_DENSE.num_params() == 37_445_852_160


def test_planner_holds_what_the_exact_theory_holds():
    """The planner's closed form per rank (theory/planner/stages.py) keeps MLA's latent projections
    whole over tp, as the exact per-parameter walk does (theory/exact/params.py)."""
    from labkit import ParallelConfig
    from labkit.theory.exact.params import rank_param_count
    from labkit.theory.planner.stages import stage_params, stages
    from labkit.theory.presets import DEEPSEEK_V3_DENSE

    for cfg in (ParallelConfig(tp=8, dp=1), ParallelConfig(tp=4, pp=2, microbatches=2)):
        for st in stages(cfg, DEEPSEEK_V3_DENSE):
            assert sum(stage_params(DEEPSEEK_V3_DENSE, cfg, st)) == rank_param_count(cfg, DEEPSEEK_V3_DENSE, st.rank)
    # the latents: wq_a 7168·1536 + q_norm 1536 + wkv_a 7168·576 + kv_norm 512 per layer, on every tp rank
    whole = 7168 * 1536 + 1536 + 7168 * 576 + 512
    split = 187_107_328 - whole
    tp8 = ParallelConfig(tp=8, dp=1)
    layer = rank_param_count(tp8, DEEPSEEK_V3_DENSE.replace(layers=2), 0) - rank_param_count(
        tp8, DEEPSEEK_V3_DENSE.replace(layers=1), 0
    )
    assert layer == whole + split // 8 + 3 * 7168 * 18432 // 8 + 2 * 7168


def test_ring_message_is_the_up_projected_heads():
    """DeepSeek-V3 (bf16) per token, layer and hop: 2 · 128/t heads · 192 (v padded from 128) · 2
    bytes = 98,304 at t = 1, 12,288 at t = 8; the compressed latent would be (512 + 64) · 2 = 1,152
    whatever t (not built, DERIVATIONS.md says why)."""
    from labkit import ParallelConfig, theory
    from labkit.theory.exact.context import kv_message_bytes
    from labkit.theory.exact.latent import ring_bytes_per_token
    from labkit.theory.presets import DEEPSEEK_V3_DENSE as V3

    assert [ring_bytes_per_token(V3, t, 2) for t in (1, 8)] == [98_304, 12_288]
    assert ring_bytes_per_token(V3, 8, 2, latent=True) == 1_152
    cfg = ParallelConfig(tp=8, cp=4, global_batch=1, precision="bf16")
    assert kv_message_bytes(cfg, V3, 1, 2) == 12_288 * 4096 // 4
    layout = dict(tp=8, cp=2, pp=4, dp=2, microbatches=8, global_batch=16, stage_layers=(16, 15, 15, 15))
    plan = theory.evaluate(ParallelConfig(**layout, precision="bf16"), V3)
    assert plan.step_seconds > 0 and plan.peak_bytes > 0


def test_what_is_not_built_is_refused_at_the_door():
    from labkit import ParallelConfig
    from labkit.config.validation import problems

    found = " ".join(problems(ParallelConfig(), ModelConfig(arch="deepseek_v3")))
    assert "kv_lora_rank=None: arch='deepseek_v3' needs it >= 1" in found
    found = " ".join(problems(ParallelConfig(), ModelConfig(arch="llama", kv_lora_rank=8)))
    assert "kv_lora_rank=8: multi-head latent attention's fields apply to arch='deepseek_v3' only" in found
    found = " ".join(problems(ParallelConfig(tp=2, impl="torch"), MLA))
    assert "labkit's DTensor plan has no MLA rows" in found
    assert "kv_heads=2" in " ".join(problems(ParallelConfig(), MLA.replace(kv_heads=2)))
    assert not problems(ParallelConfig(tp=4, cp=2, sequence_parallel=True), MLA)
    with pytest.raises(ConfigError, match="yarn.factor=0.0 must be > 0"):
        MLA.replace(yarn={"factor": 0.0})
