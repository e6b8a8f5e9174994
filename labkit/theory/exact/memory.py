"""Memory formulas of the papers and of the lab's model: model states per ZeRO stage
(Rajbhandari et al., SC 2020, section 3.1 and figure 1), activations the plain lab model saves
for backward, and Korthikanti et al.'s published per-layer activation table. What one rank of
a composed layout holds is theory/exact/per_rank.py's roll-up of every strategy's rules. What a
CUDA GPU holds at scale is another model, the planner's (theory/planner/gpu_memory.py: the peak
with the allocator's reserve, NCCL's buffers, the CUDA context and the backward's transients).
"""

from __future__ import annotations

from labkit.config import ModelConfig
from labkit.config.choices import recomputation, sharded, zero_stages
from labkit.theory.exact import latent
from labkit.theory.exact.experts import layer_activation_bytes

STATE_BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp8": (2, 2, 12)}
"""Bytes per parameter of (params, grads, optimizer state): fp32 keeps Adam's two moments; 16-bit
training (the paper's fp16, bf16, and fp8, which keeps bf16 weights) adds fp32 master weights."""


def model_state_bytes(params: int, dp: int, precision: str = "bf16") -> dict[str, dict[str, float]]:
    """Bytes per rank of params / grads / optimizer for each ZeRO stage (ZeRO paper, figure 1):
    with K bytes of optimizer state per parameter and N_d = dp ranks,
        none (2 + 2 + K)Ψ,  zero1 (2 + 2)Ψ + KΨ/N_d,  zero2 2Ψ + (2 + K)Ψ/N_d,  zero3 (2 + 2 + K)Ψ/N_d.

    precision 'bf16' (or 'fp16'): 2 + 2 + 12 bytes per parameter; 'fp32': 4 + 4 + 8.
    Returns {'none' | 'zero1' | 'zero2' | 'zero3': {'params', 'grads', 'optimizer', 'total'}}.
    """
    if precision not in STATE_BYTES:
        raise ValueError(f"precision={precision!r}: use 'fp32', 'bf16' or 'fp8'")
    p, g, k = STATE_BYTES[precision]
    psi, n = float(params), float(dp)
    out = {}
    for name in zero_stages().values():  # each state divided by N_d where the stage shards it
        sh = sharded(name)
        a, b, c = (
            p * psi / (n if sh.params else 1),
            g * psi / (n if sh.grads else 1),
            k * psi / (n if sh.optimizer else 1),
        )
        out[name] = {"params": a, "grads": b, "optimizer": c, "total": a + b + c}
    return out


def activation_bytes(
    m: ModelConfig,
    batch: int,
    layers: int | None = None,
    head: bool = True,
    embed: bool = True,
    act_bytes: int = 4,
    tables: int | None = None,
) -> int:
    """Bytes the model saves for backward for one (batch, seq) microbatch, counted from what each
    op keeps (pre-norm block, no dropout, PyTorch's CPU flash attention; a = heads, kv = KV heads
    times head_dim, e = act_bytes):

      gpt, gpt2  per block  e(6bsh + 2bs·kv + 4bs): LN inputs and outputs, q, attention output,
                            k and v, LN mean and rstd; + 2e·bsf (fc1 out, GELU out) + 4abs (lse)
                 head       e(2bsh + 2bs) + 4bsV (log-softmax, fp32) + 8bs targets + one fp32 scalar;
                            with loss='fused' e·bsV (the logits) + 4bs (log-sum-exp) + 8bs targets
                 embedding  8bs token ids + 8s positions
      llama      per block  8(2bsh + bs): two RMSNorms keep input, rstd and normalised input, in fp32
                            whatever the compute dtype (torch's nn.RMSNorm upcasts); e(4bsh + 2bs·kv):
                            the norms' outputs, rotated q, attention output, rotated k and v;
                            4e·bsf (SwiGLU: gate out, SiLU out, up out, their product) + 4abs (lse)
                 head       4(2bsh + bs) + e·bsh + 4bsV + 8bs + 4
                 embedding  8bs token ids; the rotary cos and sin tables 2e·s·hd, one pair per
                            forward of a chunk with blocks (every block keeps the same two)
    An MoE layer keeps what theory/exact/experts.py lists in place of the dense MLP's.

    act_bytes: bytes per activation element (4 fp32, 2 bf16). PyTorch's CPU LayerNorm keeps its
    mean and rstd in the activation dtype (its CUDA kernel keeps them in fp32).

    (Korthikanti et al.'s sbh(34 + 5as/h) counts a different block: dropout masks, stored
    softmax scores; `korthikanti_layer_bytes` gives that published formula.)
    """
    b, s, h, f, a, v, e = batch, m.seq, m.hidden, m.ffn, m.heads, m.vocab, act_bytes
    kv = m.n_kv_heads * m.head_dim
    if layers is None and m.experts and m.dense_layers:  # the whole model: its first dense blocks apart
        d = min(m.dense_layers, m.layers)
        rotary = 2 * e * s * m.head_dim if m.family.rotary and d and m.layers > d else 0  # one pair of tables
        dense = activation_bytes(m.replace(experts=0), batch, d, head, embed, act_bytes)
        return dense + activation_bytes(m, batch, m.layers - d, False, False, act_bytes) - rotary
    layers = m.layers if layers is None else layers
    fam = m.family
    if m.experts:
        mlp = layer_activation_bytes(m, b, s, e)
    else:
        mlp = e * (4 if fam.gated_mlp else 2) * b * s * f
    if fam.latent_attention:  # MLA's latents, kernel and wo input (theory/exact/latent.py), llama's norms
        block = 8 * (2 * b * s * h + b * s) + e * 2 * b * s * h + latent.attention_bytes(m, b, s, 1, e) + mlp
    else:
        # the two norms: RMSNorm keeps fp32 statistics and inputs, LayerNorm its input and two statistics
        norms = 8 * (2 * b * s * h + b * s) if m.norms.rms else e * (2 * b * s * h + 4 * b * s)
        # the linears' inputs, q (rotated where rotary) and the attention output, heads·head_dim wide
        # (= h unless kv_channels says otherwise), k and v
        q = a * m.head_dim
        block = norms + e * (2 * b * s * h + 2 * b * s * q + 2 * b * s * kv) + mlp + 4 * a * b * s
        block += qk_norm_bytes(m, b, s, a, m.n_kv_heads) + gemma_norm_bytes(m, b, s, s)
    total = layers * block
    if fam.rotary and layers:
        total += rotary_bytes(m, s, e, tables)  # the rotary tables
    if head:
        norm = 4 * (2 * b * s * h + b * s) + e * b * s * h if m.norms.rms else e * (2 * b * s * h + 2 * b * s)
        norm += 4 * h if fam.offset_norm else 0  # Gemma's (1 + w)
        # 'fp32': log_softmax's fp32 output, nll's targets and total weight; 'fused': the
        # logits, each row's fp32 log-sum-exp and the targets (engines/loss.py)
        loss = e * b * s * v + 4 * b * s + 8 * b * s if m.fused_loss else 4 * b * s * v + 8 * b * s + 4
        total += norm + loss
    if embed:
        total += 8 * b * s + (0 if fam.rotary else 8 * s)  # a position table keeps the positions
        total += e if fam.scaled_embedding else 0  # Gemma's sqrt(h), a 0-dim tensor in the compute dtype
    return total


def gemma_norm_bytes(m: ModelConfig, b: int, rows: int, s: int) -> int:
    """What Gemma 3's block keeps beyond a llama block's (measured, engines/layers.py OffsetRMSNorm):
    two more RMSNorms (after attention and after the MLP, on the `rows` the stream holds), each
    keeping its input, normalised input and rstd in fp32, and every one of the four its (1 + w),
    h fp32; 0 for the other families. The sliding window's mask: window_mask_bytes."""
    if not m.family.sandwich_norm:
        return 0
    return 2 * 4 * (2 * b * rows * m.hidden + b * rows) + 4 * 4 * m.hidden


def window_mask_bytes(m: ModelConfig, s: int, e: int) -> int:
    """A local layer's mask as PyTorch's SDPA keeps it for backward: (s, s) in the compute dtype (the
    CPU kernel turns the boolean mask into an additive one; measured 4096 bytes at s = 32, fp32)."""
    return e * s * s


def rotary_bytes(m: ModelConfig, s: int, e: int, tables: int | None = None) -> int:
    """The cos and sin tables (s, head_dim) a chunk keeps per forward: one pair per kind of rotating
    layer it holds (`tables`; default every kind the model has: two with a local RoPE base, Gemma 3),
    a pair no block of the chunk uses being saved by nothing."""
    if m.family.latent_attention:  # MLA's tables are qk_rope_head_dim wide (theory/exact/latent.py)
        return latent.rotary_bytes(m, s, e)
    if tables is None:
        tables = 2 if m.rope_local_theta is not None else 1
    return tables * 2 * e * s * m.head_dim


def table_kinds(m: ModelConfig, blocks) -> int:
    """The rotary pairs a chunk of `blocks` keeps: the kinds (local base, global) of its rotating layers."""
    return len({m.layer_local(i) and m.rope_local_theta is not None for i in blocks if m.layer_rotates(i)})


def qk_norm_bytes(m: ModelConfig, b: int, s: int, heads: int, kv_heads: int) -> int:
    """Qwen3's q_norm and k_norm (`heads` query and `kv_heads` KV heads of this rank): each RMSNorm keeps
    its input and normalised output in fp32 and one fp32 rstd per head and position (measured: torch's
    CPU rms_norm); 0 without qk_norm."""
    if not m.qk_norm:
        return 0
    hd = m.head_dim
    offset = 2 * 4 * hd if m.family.offset_norm else 0  # Gemma's (1 + w), one per norm
    return 4 * (2 * b * s * heads * hd + b * s * heads) + 4 * (2 * b * s * kv_heads * hd + b * s * kv_heads) + offset


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes per transformer layer, Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models" (MLSys 2023), table 2 (16-bit activations):
      no parallelism                 sbh (34 + 5as/h)
      tensor parallel                sbh (10 + 24/t + 5as/(ht))
      tensor + sequence parallel     sbh (34/t + 5as/(ht))
      + selective recomputation      sbh (34/t) with SP, sbh (10 + 24/t) without
      full recomputation             2sbh (the layer's input only)
    """
    base = s * b * h
    r = recomputation(recompute)
    if r.keeps_input_only:
        return 2.0 * base
    attn = 5 * a * s / (h * t)
    if r.attention_only:
        attn = 0.0
    if sp:
        return base * (34 / t + attn)
    return base * (10 + 24 / t + attn)
