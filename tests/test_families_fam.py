"""The dense attention families — Qwen3 (per-head q/k RMSNorm, head_dim apart from
hidden / heads), SmolLM3 (no RoPE on every 4th layer) and Gemma 3's text model (local:global
sliding-window layers with their own RoPE bases, query_pre_attn_scalar, GeGLU, four (1 + w) norms a
block, a sqrt(h)-scaled tied embedding) — against transformers' own implementation:
parameter counts equal to transformers' model built on the meta device from the same published
config, and logits equal on small configs with every weight moved off its initial value. Runs
where transformers is installed (not a labkit dependency); no network, no weights downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from labkit import ConfigError, ModelConfig, theory
from labkit.theory.presets import PRESETS, PUBLISHED_PARAMS

T = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "data"))
sys.path.insert(0, str(Path(__file__).parent))
from hf_configs import MISTRAL_7B_V01  # noqa: E402
from hf_configs_fam import GEMMA3_27B, QWEN3_8B, SMOLLM3_3B  # noqa: E402
from test_hf_numerics import llama_weights, logits  # noqa: E402

PUBLISHED = {"qwen3-8b": QWEN3_8B, "smollm3-3b": SMOLLM3_3B, "gemma3-27b": GEMMA3_27B}


def hf_config(config: dict):
    """transformers' config of a published dict (a Gemma 3 checkpoint: its text_config, the language model)."""
    c = config.get("text_config", config)
    kind = "gemma3_text" if "text_config" in config else c["model_type"]
    return T.AutoConfig.for_model(kind, **{k: v for k, v in c.items() if k not in ("architectures", "model_type")})


def hf_count(config) -> int:
    with torch.device("meta"):
        net = T.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes_count_as_transformers(name):
    model = ModelConfig.from_hf(PUBLISHED[name])
    assert model == PRESETS[name]  # the preset is the published config, field by field
    count = hf_count(hf_config(PUBLISHED[name]))
    assert model.num_params() == theory.num_params(model) == count == PUBLISHED_PARAMS[name]


def test_transformers_written_configs_read_too():
    """The rope_parameters / layer_types spelling transformers >= 5 writes, for each family's defaults."""
    for kind in ("qwen3", "smollm3", "gemma3_text"):
        config = T.AutoConfig.for_model(kind)
        model = ModelConfig.from_hf(config.to_dict(), seq=8192)
        assert model.num_params() == hf_count(config), kind
    gemma = ModelConfig.from_hf(T.AutoConfig.for_model("gemma3_text").to_dict(), seq=8192)
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.kv_channels) == (1e6, 1e4, 256)
    assert [gemma.layer_window(i) for i in range(6)] == [4096] * 5 + [None]


SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, vocab_size=211)
CASES = {
    # head_dim 32 with 4 heads on h 64: q is 128 wide, apart from hidden
    "qwen3": ({**QWEN3_8B, **SMALL, "num_key_value_heads": 2, "head_dim": 32}, 64),
    "qwen3-tied": ({**QWEN3_8B, **SMALL, "num_key_value_heads": 1, "tie_word_embeddings": True}, 64),
    # pad_token_id inside the small vocabulary (the 3B's 128004 is not): an embedding row, no architecture
    "smollm3": (
        {**SMOLLM3_3B, **SMALL, "num_key_value_heads": 2, "no_rope_layers": [1, 1, 1, 0], "pad_token_id": 0},
        64,
    ),
    # window 24 < seq 96, a global layer every 3rd, head_dim 24 apart from hidden / heads, the 27B's
    # query_pre_attn_scalar != head_dim and its linear RoPE factor on the global layers
    "gemma3": (
        {
            **GEMMA3_27B,
            "text_config": {
                **GEMMA3_27B["text_config"],
                **SMALL,
                "num_hidden_layers": 6,
                "num_key_value_heads": 2,
                "head_dim": 24,
                "query_pre_attn_scalar": 20,
                "sliding_window": 24,
                "sliding_window_pattern": 3,
            },
        },
        96,
    ),
    # Mistral 7B v0.1's window on every layer, 24 < seq 64 (labkit/config/hf/)
    "mistral-window": ({**MISTRAL_7B_V01, **SMALL, "num_key_value_heads": 2, "sliding_window": 24}, 64),
}


def weights(net, cfg) -> dict:
    """HF's names for labkit's weights: the llama family's, with q_norm / k_norm and Gemma's norms."""
    sd = llama_weights(net, cfg)
    for i, b in enumerate(net.blocks):
        p = f"model.layers.{i}."
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = (
                b.attn.q_norm.weight,
                b.attn.k_norm.weight,
            )
        if cfg.family.sandwich_norm:  # HF's post_attention_layernorm is ln1_post; its pre_feedforward one is ln2
            sd[p + "post_attention_layernorm.weight"] = b.ln1_post.weight
            sd[p + "pre_feedforward_layernorm.weight"] = b.ln2.weight
            sd[p + "post_feedforward_layernorm.weight"] = b.ln2_post.weight
    return sd


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(name):
    from labkit.engines.model import build_model

    published, seq = CASES[name]
    cfg = ModelConfig.from_hf(published, seq=seq)
    net = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():  # off 1 and 0 (norms), so that every weight matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    config = hf_config(published)
    config._attn_implementation = "eager"
    hf = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()  # the configs say bfloat16
    sd = {k: v.detach().clone() for k, v in weights(net, cfg).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all(m == "lm_head.weight" and cfg.tied for m in missing), (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab, (2, seq), generator=gen)
    with torch.no_grad():
        ours, theirs = logits(net, tokens), hf(tokens).logits
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert err <= 1e-5, err


def test_the_variants_matter():
    """Each feature changes the logits (a check that cannot fail proves nothing): without the window,
    with every layer rotating, without q/k norms, the model is another one."""
    from labkit.engines.model import build_model

    published, seq = CASES["gemma3"]
    cfg = ModelConfig.from_hf(published, seq=seq)
    tokens = torch.randint(0, cfg.vocab, (1, seq), generator=torch.Generator().manual_seed(2))

    def out(c):
        net = build_model(c, 0)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            return logits(net, tokens)

    base = out(cfg)
    for change in (dict(sliding_window=None, window_pattern=0, rope_local_theta=None), dict(rope_linear_factor=1.0)):
        assert (out(cfg.replace(**change)) - base).abs().max() > 1e-4, change
    for change in (dict(qk_norm=False), dict(query_pre_attn_scalar=None)):
        assert (out(cfg.replace(**change)) - base).abs().max() > 1e-4, change
    smol = ModelConfig.from_hf(CASES["smollm3"][0], seq=64)
    t = tokens[:, :64] % smol.vocab
    nets = [build_model(m, 0) for m in (smol, smol.replace(nope_interval=0))]
    assert (logits(nets[0], t) - logits(nets[1], t)).abs().max() > 1e-4


@pytest.mark.parametrize(
    "change, says",
    [
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling="),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_qwen3_refuses_what_is_not_built(change, says):
    with pytest.raises(ConfigError, match=says):
        ModelConfig.from_hf({**QWEN3_8B, **change})


def test_refusals_of_smollm3_and_gemma3():
    with pytest.raises(ConfigError, match="no_rope_layers leaves layers"):
        ModelConfig.from_hf(
            {**SMOLLM3_3B, "no_rope_layers": [1] * 35 + [0], "no_rope_layer_interval": 4}
            | {"no_rope_layers": [0] + [1] * 35}
        )
    text = GEMMA3_27B["text_config"]
    for change, says in (
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"layer_types": ["full_attention"] * 62}, "layer_types="),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "linear scaling only"),
    ):
        with pytest.raises(ConfigError, match=says):
            ModelConfig.from_hf({**GEMMA3_27B, "text_config": {**text, **change}})
