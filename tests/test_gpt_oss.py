"""GPT-OSS: GptOssForCausalLM's config read whole by from_hf, the published sizes counted like
transformers' models on the meta device, and a small config's logits equal transformers' on the same weights,
with each of its parts biting (the window, the sinks, the clamp of the SwiGLU, the router's bias)."""

from __future__ import annotations

import pytest
import torch

from labkit import ConfigError, ModelConfig, theory
from labkit.engines import moe as moe_module
from labkit.engines.model import build_model
from labkit.theory.presets import PRESETS, PUBLISHED_PARAMS

T = pytest.importorskip("transformers")

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "initial_context_length": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "experts_per_token": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088,
}  # fmt: skip
"""huggingface.co/openai/gpt-oss-20b config.json (the fields that decide the architecture; its mxfp4
quantization_config is how the weights are stored)."""
GPT_OSS_120B = {
    **GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}  # fmt: skip
"""huggingface.co/openai/gpt-oss-120b config.json: 36 layers of 128 experts, the rest as 20b's."""


def hf_config(c: dict):
    return T.AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"})


@pytest.mark.parametrize(
    "name, c, count", [("gpt-oss-20b", GPT_OSS_20B, 20_914_757_184), ("gpt-oss-120b", GPT_OSS_120B, 116_829_156_672)]
)
def test_the_published_sizes_count_as_transformers(name, c, count):
    with torch.device("meta"):
        hf = T.GptOssForCausalLM(hf_config(c))
    m = ModelConfig.from_hf(c, seq=4096)
    assert (m.arch, m.kv_channels, m.sliding_window, m.window_pattern, m.top_k) == ("gpt_oss", 64, 128, 2, 4)
    assert (m.yarn.factor, m.yarn.truncate, m.rope_theta) == (32.0, False, 150000.0)
    assert [m.layer_window(i) for i in range(4)] == [128, None, 128, None]  # sliding first, as layer_types
    assert m.num_params() == sum(p.numel() for p in hf.parameters()) == count == theory.num_params(m)
    assert ModelConfig.from_hf(c) == PRESETS[name] and PUBLISHED_PARAMS[name] == count


def test_active_parameters_are_the_model_card_s():
    """OpenAI's model card, table 1: 3.61B and 5.13B active, the unembedding counted, the embedding not."""
    for name, card in (("gpt-oss-20b", 3.61e9), ("gpt-oss-120b", 5.13e9)):
        m = PRESETS[name]
        active = theory.active_params(m) - m.vocab * m.hidden
        assert abs(active - card) < 0.005e9, (name, active)


SMALL = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 24, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 97, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 64,
    "rope_scaling": {**GPT_OSS_20B["rope_scaling"], "original_max_position_embeddings": 16},
}  # fmt: skip
"""A small GPT-OSS: a local layer (window 8 < the 32 tokens) then a global one, 8 experts, YaRN from 16."""


def _weights(net) -> dict:
    """transformers' names for labkit's GPT-OSS weights: gate and up interleaved in gate_up_proj (E, h, 2f)."""
    sd = {"model.embed_tokens.weight": net.embed.tok.weight, "model.norm.weight": net.head.norm.weight}
    sd["lm_head.weight"] = net.head.proj.weight
    for i, b in enumerate(net.blocks):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"] = b.ln1.weight, b.ln2.weight
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            sd[p + f"self_attn.{theirs}.weight"] = getattr(b.attn, ours).weight
            sd[p + f"self_attn.{theirs}.bias"] = getattr(b.attn, ours).bias
        sd[p + "self_attn.sinks"] = b.attn.sinks
        m = b.mlp
        sd[p + "mlp.router.weight"], sd[p + "mlp.router.bias"] = m.router.weight, m.router.bias
        e, h, f = m.w1.shape
        sd[p + "mlp.experts.gate_up_proj"] = torch.stack([m.w1, m.w3], dim=-1).reshape(e, h, 2 * f)
        sd[p + "mlp.experts.gate_up_proj_bias"] = torch.stack([m.w1_bias, m.w3_bias], dim=-1).reshape(e, 2 * f)
        sd[p + "mlp.experts.down_proj"], sd[p + "mlp.experts.down_proj_bias"] = m.w2, m.w2_bias
    return sd


def _small():
    """(labkit's model, transformers' on the same weights, tokens): every weight moved, the sinks and biases
    drawn, the experts' weights large enough that the SwiGLU's clamp at 7 bites."""
    c = {**GPT_OSS_20B, **SMALL}
    cfg = ModelConfig.from_hf(c, seq=32)
    net = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in net.parameters():  # off 0 and 1 (biases, norms), so that every weight matters
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for b in net.blocks:
            b.attn.sinks.copy_(torch.randn(cfg.heads, generator=gen))
            b.mlp.router.bias.copy_(torch.randn(cfg.experts, generator=gen) * 0.5)
            for w in (b.mlp.w1, b.mlp.w3):
                w.copy_(torch.randn(w.shape, generator=gen) * 1.5)
    config = hf_config(c)
    config._attn_implementation = "eager"
    hf = T.GptOssForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in _weights(net).items()})
    assert not missing and not unexpected, (missing, unexpected)
    return net, hf, torch.randint(0, cfg.vocab, (2, 32), generator=gen)


def test_logits_equal_transformers(monkeypatch):
    from test_hf_numerics import logits

    net, hf, tokens = _small()
    with torch.no_grad():
        ours, theirs = logits(net, tokens), hf(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    # each part bites: the logits move past the bound without the sinks, the window, the clamp or the router's bias
    far = 1e-3 * theirs.abs().max()
    with torch.no_grad():
        sinks = [b.attn.sinks.clone() for b in net.blocks]
        for b in net.blocks:
            b.attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        assert (logits(net, tokens) - theirs).abs().max() > far
        for b, s in zip(net.blocks, sinks):
            b.attn.sinks.copy_(s)
        net.blocks[0].attn.window = None
        assert (logits(net, tokens) - theirs).abs().max() > far
        net.blocks[0].attn.window = 8
        monkeypatch.setattr(moe_module, "SWIGLU_LIMIT", 1e9)
        assert (logits(net, tokens) - theirs).abs().max() > far
        monkeypatch.setattr(moe_module, "SWIGLU_LIMIT", 7.0)
        for b in net.blocks:
            b.mlp.router.bias.zero_()
        assert (logits(net, tokens) - theirs).abs().max() > far


@pytest.mark.parametrize(
    "change, match",
    [
        ({"swiglu_limit": 10.0}, "swiglu_limit=10.0"),
        ({"attention_bias": False}, "attention_bias=False"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types="),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ],
)
def test_what_is_not_built_is_refused_by_name(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf({**GPT_OSS_20B, **change}, seq=4096)


class _Ring:
    """A cp ring without a transport: member `rank` of `cp`, each hop handing it the K/V block the previous
    member held one step before (what engines/parallel/context/ Ring receives), for the forward only."""

    def __init__(self, rank: int, cp: int, blocks: list):
        from labkit.engines.parallel.context import ring_schedule

        self.rank, self.cp, self.n_chunks, self.blocks = rank, cp, 2, blocks
        self.schedule, self.t = ring_schedule(rank, cp), 0

    def hop(self, send, tag):
        self.t += 1
        return self.blocks[(self.rank - self.t) % self.cp], []


def test_the_ring_joins_each_sink_once_per_query():
    """engines/parallel/context/'s ring forward on cp = 4 zigzag ranks equals sink_attention on the whole
    sequence; without its sinks, or with the sink joined into every block's partial result (cp times on the
    last chunks' queries), it does not."""
    from labkit.engines.layers import sink_attention
    from labkit.engines.parallel.context import _RingAttention, zigzag_index

    gen = torch.Generator().manual_seed(4)
    b, nh, nkv, s, hd, cp = 2, 4, 2, 16, 8, 4
    q, k, v = (torch.randn(b, n, s, hd, generator=gen, dtype=torch.float64) for n in (nh, nkv, nkv))
    sinks = torch.randn(nh, generator=gen, dtype=torch.float64)
    want = sink_attention(q, k, v, sinks, None)  # (b, nh, s, hd)
    idx = [zigzag_index(s, cp, r) for r in range(cp)]
    blocks = [torch.stack([k[:, :, i], v[:, :, i]]) for i in idx]  # what each member holds: (2, b, nkv, s/cp, hd)

    def ring(r, sinks):
        return _RingAttention.forward(
            _Ctx(), q[:, :, idx[r]], k[:, :, idx[r]], v[:, :, idx[r]], _Ring(r, cp, blocks), sinks
        )

    for r in range(cp):
        assert torch.allclose(ring(r, sinks), want[:, :, idx[r]], atol=1e-12)
    last = idx[0][s // (2 * cp) :]  # rank 0's second chunk: queries that see every block of the ring
    assert (ring(0, None)[:, :, s // (2 * cp) :] - want[:, :, last]).abs().max() > 1e-2
    # a sink counted once per block: a block's softmax mass shrunk by each partial's own sink term
    per_block = torch.zeros_like(want[:, :, last])
    norm = torch.zeros(b, nh, len(last), 1, dtype=torch.float64)
    for r in range(cp):
        keys = idx[r][idx[r] <= last.max()]
        sc = q[:, :, last] @ k.repeat_interleave(nh // nkv, 1)[:, :, keys].transpose(2, 3) * hd**-0.5
        sc = sc.masked_fill(last[:, None] < keys[None, :], float("-inf"))
        w = sc.exp()
        per_block += w @ v.repeat_interleave(nh // nkv, 1)[:, :, keys]
        norm += w.sum(-1, keepdim=True) + sinks.exp().view(1, nh, 1, 1)  # the sink in every block's sum
    assert (per_block / norm - want[:, :, last]).abs().max() > 1e-2


class _Ctx:
    """A stand-in for autograd's ctx: the forward only saves."""

    def save_for_backward(self, *tensors):
        self.saved = tensors
