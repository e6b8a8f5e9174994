"""Each family computes what Hugging Face's own implementation computes, given the same weights:
the logits of labkit's model and of transformers' LlamaForCausalLM (Llama 2, 3.1 with its RoPE
scaling, 3.2 tied), MixtralForCausalLM, Qwen2ForCausalLM and GPT2LMHeadModel agree to fp32
rounding (relative 1e-5; measured 3e-7 to 6e-7). Every weight, norms and biases included, is
moved off its initial value first, so nothing passes by being 0 or 1. Runs where transformers is
installed (it is not a labkit dependency); no network, no downloaded weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from labkit import ModelConfig

T = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent / "data"))
from hf_configs import GPT2, LLAMA2_7B, LLAMA31_8B, LLAMA32_1B, MIXTRAL_8X7B, QWEN2_05B  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=211)
CASES = {
    "llama3.1": ({**LLAMA31_8B, **SMALL, "num_key_value_heads": 2}, 64),
    # original context 256 and 1,024 positions: every band of the llama3 scaling is exercised
    "llama3.1-long": (
        {
            **LLAMA31_8B,
            **SMALL,
            "num_key_value_heads": 2,
            "rope_scaling": {**LLAMA31_8B["rope_scaling"], "original_max_position_embeddings": 256},
        },
        1024,
    ),
    "llama3.2-tied": ({**LLAMA32_1B, **SMALL, "num_key_value_heads": 1, "head_dim": 16}, 64),
    "llama2": ({**LLAMA2_7B, **SMALL, "num_key_value_heads": 4}, 64),
    "mixtral": ({**MIXTRAL_8X7B, **SMALL, "num_key_value_heads": 2, "num_local_experts": 4}, 64),
    "qwen2": ({**QWEN2_05B, **SMALL, "num_key_value_heads": 2}, 64),
    "gpt2": ({**GPT2, "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 211, "n_positions": 128}, 128),
}


def logits(net, tokens):
    """labkit's logits (the model's forward stops at the loss)."""
    pos = torch.arange(tokens.shape[1])
    x = net.embed(tokens, pos)
    rope = net.rope(pos, x.dtype) if net.rope is not None else None
    for block in net.blocks:
        x = block(x, rope)
    return net.head.proj(net.head.norm(x))


def llama_weights(net, cfg, fused_experts: bool = False) -> dict:
    """HF's names for labkit's llama-family weights (HF Linear and ours both store (out, in);
    Mixtral's experts are (in, out) here, matmul-ready)."""
    sd = {"model.embed_tokens.weight": net.embed.tok.weight, "model.norm.weight": net.head.norm.weight}
    if not cfg.tied:
        sd["lm_head.weight"] = net.head.proj.weight
    for i, b in enumerate(net.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = b.ln1.weight, b.ln2.weight
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            lin = getattr(b.attn, ours)
            sd[p + f"self_attn.{theirs}.weight"] = lin.weight
            if lin.bias is not None:
                sd[p + f"self_attn.{theirs}.bias"] = lin.bias
        if cfg.experts and fused_experts:  # transformers >= 5: an expert's gate and up in one (E, 2f, h)
            sd[p + "mlp.gate.weight"] = b.mlp.router.weight
            sd[p + "mlp.experts.gate_up_proj"] = torch.cat([b.mlp.w1.transpose(1, 2), b.mlp.w3.transpose(1, 2)], 1)
            sd[p + "mlp.experts.down_proj"] = b.mlp.w2.transpose(1, 2)
        elif cfg.experts:  # transformers 4: one Linear per expert and weight
            sd[p + "block_sparse_moe.gate.weight"] = b.mlp.router.weight
            for j in range(cfg.experts):
                for w in ("w1", "w2", "w3"):
                    sd[p + f"block_sparse_moe.experts.{j}.{w}.weight"] = getattr(b.mlp, w)[j].T
        else:
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                sd[p + f"mlp.{theirs}.weight"] = getattr(b.mlp, ours).weight
    return sd


def gpt2_weights(net) -> dict:
    """HF GPT-2's names (its Conv1D stores (in, out); q, k, v fused in c_attn)."""
    sd = {"transformer.wte.weight": net.embed.tok.weight, "transformer.wpe.weight": net.embed.pos.weight}
    sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = net.head.norm.weight, net.head.norm.bias
    for i, b in enumerate(net.blocks):
        p, a = f"transformer.h.{i}.", b.attn
        for ours, theirs in ((b.ln1, "ln_1"), (b.ln2, "ln_2")):
            sd[p + theirs + ".weight"], sd[p + theirs + ".bias"] = ours.weight, ours.bias
        sd[p + "attn.c_attn.weight"] = torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).T
        sd[p + "attn.c_attn.bias"] = torch.cat([a.wq.bias, a.wk.bias, a.wv.bias])
        for lin, theirs in ((a.wo, "attn.c_proj"), (b.mlp.fc1, "mlp.c_fc"), (b.mlp.fc2, "mlp.c_proj")):
            sd[p + theirs + ".weight"], sd[p + theirs + ".bias"] = lin.weight.T, lin.bias
    return sd


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_hugging_faces(name):
    from labkit.engines.model import build_model

    hf_config, seq = CASES[name]
    cfg = ModelConfig.from_hf(hf_config, seq=seq)
    net = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():  # off 1 and 0 (norms, biases), so that every weight matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    config = T.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    config._attn_implementation = "eager"
    hf = getattr(T, hf_config["architectures"][0])(config).eval()
    sd = (
        gpt2_weights(net)
        if cfg.arch == "gpt2"
        else llama_weights(net, cfg, any(k.endswith("experts.gate_up_proj") for k in hf.state_dict()))
    )
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all(m == "lm_head.weight" and cfg.tied for m in missing), (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab, (2, seq), generator=gen)
    with torch.no_grad():
        ours, theirs = logits(net, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
