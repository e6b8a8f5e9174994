"""The model's parameters, by name and shape, for each family, without building it (no torch).

Must list exactly what labkit.engines.model.GPT registers, in the same order; a test checks it.
`num_params` is the whole model counted once (Ψ); what one rank holds after the pp, ep and tp
splits is theory/exact/params.py's `rank_param_count`, in closed form theory/planner/stages.py's.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig
from labkit.config.latent import mla_shapes


@lru_cache(maxsize=64)
def param_shapes(m: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every parameter, in registration order; a tied head is the embedding
    (listed once, as embed.tok.weight)."""
    h, f, v, s = m.hidden, m.ffn, m.vocab, m.seq
    kv, q = m.n_kv_heads * m.head_dim, m.heads * m.head_dim  # q = h unless kv_channels sets head_dim
    fam = m.family
    # a rotary model (llama) has no position table
    out = [("embed.tok.weight", (v, h))] + ([] if fam.rotary else [("embed.pos.weight", (s, h))])

    def norm(name: str) -> list:  # a weight, and LayerNorm's bias (ModelConfig.norm)
        return [(name + ".weight", (h,))] + ([(name + ".bias", (h,))] if m.norms.bias else [])

    def linear(name: str, rows: int, cols: int, bias: bool) -> list:
        return [(name + ".weight", (rows, cols))] + ([(name + ".bias", (rows,))] if bias else [])

    # gpt2 has biases everywhere; Qwen2 (llama family) on q, k and v alone
    qkv_bias = fam.biases or m.qkv_bias
    for i in range(m.layers):
        b = f"blocks.{i}."
        out += norm(b + "ln1")
        if fam.latent_attention:  # MLA (deepseek_v3): its latents' projections and norms
            out += [(b + "attn." + name, shape) for name, shape in mla_shapes(m)]
        else:
            # GPT-OSS: the sinks are attn's own parameter, listed before its submodules'; q, k, v, o biased
            out += [(b + "attn.sinks", (m.heads,))] if fam.sinks else []
            qkv_bias, o_bias = qkv_bias or fam.attention_biases, fam.biases or fam.attention_biases
            out += linear(b + "attn.wq", q, h, qkv_bias) + linear(b + "attn.wk", kv, h, qkv_bias)
            out += linear(b + "attn.wv", kv, h, qkv_bias) + linear(b + "attn.wo", h, q, o_bias)
        if m.qk_norm:  # Qwen3, Gemma 3: one RMSNorm over head_dim for q's heads, one for k's
            out += [(b + "attn.q_norm.weight", (m.head_dim,)), (b + "attn.k_norm.weight", (m.head_dim,))]
        out += norm(b + "ln2")
        if m.moe_layer(i):  # the first dense_layers blocks keep the dense MLP below
            fe, fs = m.expert_ffn, m.expert_ffn * m.shared_experts  # an expert's width; the shared MLP's
            # a module's own parameters come before its submodules' (nn.Module.named_parameters)
            out += [(b + "mlp.w1", (m.experts, h, fe)), (b + "mlp.w2", (m.experts, fe, h))]
            out += [(b + "mlp.w3", (m.experts, h, fe))] if fam.gated_mlp else []
            if fam.clamped_experts:  # GPT-OSS: each expert's gate, up and down biases, and the router's
                out += [(b + "mlp.w1_bias", (m.experts, fe)), (b + "mlp.w3_bias", (m.experts, fe))]
                out += [(b + "mlp.w2_bias", (m.experts, h))]
            out += linear(b + "mlp.router", m.experts, h, fam.clamped_experts)
            if fs and fam.gated_mlp:  # the shared experts: one dense MLP (engines/moe.py MoE.shared)
                out += linear(b + "mlp.shared.gate", fs, h, False) + linear(b + "mlp.shared.up", fs, h, False)
                out += linear(b + "mlp.shared.down", h, fs, False)
            elif fs:
                out += linear(b + "mlp.shared.fc1", fs, h, fam.biases) + linear(b + "mlp.shared.fc2", h, fs, fam.biases)
        elif fam.gated_mlp:
            out += linear(b + "mlp.gate", f, h, False) + linear(b + "mlp.up", f, h, False)
            out += linear(b + "mlp.down", h, f, False)
        else:
            out += linear(b + "mlp.fc1", f, h, fam.biases) + linear(b + "mlp.fc2", h, f, fam.biases)
        if fam.sandwich_norm:  # Gemma: the sublayers' outputs normed, registered after the MLP
            out += norm(b + "ln1_post") + norm(b + "ln2_post")
    # a tied head registers no weight of its own: it is the embedding's one Parameter
    out += norm("head.norm") + ([] if m.tied else [("head.proj.weight", (v, h))])
    return tuple(out)


def num_params(m: ModelConfig) -> int:
    """Ψ: every parameter of the full model, counted once."""
    return sum(prod(s) for _, s in param_shapes(m))


def active_params(m: ModelConfig) -> float:
    """Parameters a token passes through: every dense weight, and top_k of each layer's E experts
    (the count that sets the FLOPs of an MoE model, e.g. Mixtral's 13B active of 47B)."""
    if not m.experts:
        return num_params(m)
    routed = ("mlp.w1", "mlp.w2", "mlp.w3", "mlp.w1_bias", "mlp.w2_bias", "mlp.w3_bias")
    expert = sum(prod(s) for n, s in param_shapes(m) if n.endswith(routed))
    return num_params(m) - expert + expert * m.top_k / m.experts
