"""Multi-head latent attention (arch 'deepseek_v3', engines/mla.py), predicted: what one block's
attention saves for backward and how wide the tensors are that context parallelism moves. The
rest of the block (ln1, ln2, the MLP) is the llama family's (memory.py, tensor.py). Counted from
the tensors engines/mla.py's ops keep (measured with the saved-tensor meter, tests/test_mla.py),
with b sequences, s positions (the gathered s/cp under SP), t = tp, nh/t local heads, e the
compute dtype's bytes, rq = q_lora_rank, r = kv_lora_rank, dr = qk_rope_head_dim, dv = v_head_dim
and W = max(dn + dr, dv) the kernel's head width:

    query latent  (8 rq + 4) bs + e bs rq        q_norm's fp32 input, normalised input and rstd; its output
    kv latent     4 bs (r [+ dr in fp32]) + (4 r + 4) bs + e bs r
                                                 kv_norm's fp32 input (in fp32 the whole [c_kv | k_pe]
                                                 output of wkv_a, of which c_kv is a view), the rest as q_norm's
    kernel        4 e b (nh/t) s W + 4 b (nh/t) s    q, k, v padded to W, the output; the fp32 log-sum-exp
    wo's input    e bs (nh/t) dv                 the output's first dv of W, its own copy
                                                 (selective recomputation drops the kernel's output and lse)
    rotary        e s dr (once per forward)      cos and sin (s, dr/2); the rotated parts keep nothing else

The latents are whole on every tp rank (layout/tensor.py 'latent'), so their terms do not
shrink with t; a (b, s, r + dr) latent per token is what MLA's KV cache holds at inference
(DeepSeek-V2 section 2.1.2: (d_c + d_h^R) l elements per token), against 2 nh (dn + dr)
up-projected here for the kernel.
"""

from __future__ import annotations

from labkit.config import ModelConfig


def kernel_width(model: ModelConfig) -> int:
    """W: the one head width the attention kernel sees (v zero-padded to dn + dr, or q and k to dv)."""
    return max(model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim)


def attention_bytes(model: ModelConfig, b: int, s: int, tp: int, e: int) -> int:
    """What one MLA block's attention keeps for one microbatch on one tp rank (module docstring),
    the log-sum-exp included; ln1's output (the projections' shared input) is the caller's."""
    nh, r, rq, dr = model.heads // tp, model.kv_lora_rank, model.q_lora_rank, model.qk_rope_head_dim
    q_latent = (8 * rq + 4) * b * s + e * b * s * rq if rq else 0
    # in fp32 the norm keeps wkv_a's output itself (c_kv is a view of [c_kv | k_pe]); else an fp32 copy of c_kv
    kv_latent = 4 * b * s * (r + (dr if e == 4 else 0)) + (4 * r + 4) * b * s + e * b * s * r
    kernel = 4 * e * b * nh * s * kernel_width(model) + 4 * b * nh * s
    return q_latent + kv_latent + kernel + e * b * s * nh * model.v_head_dim


def kernel_output_bytes(model: ModelConfig, b: int, s: int, tp: int, e: int) -> int:
    """The kernel's output (b, nh/t, s, W), kept by the kernel alone (wo keeps its own copy of the first
    dv): what selective recomputation drops with the log-sum-exp."""
    return e * b * (model.heads // tp) * s * kernel_width(model)


def rotary_bytes(model: ModelConfig, s: int, e: int) -> int:
    """cos and sin, (s, dr/2) each, one pair per forward of a chunk with blocks."""
    return e * s * model.qk_rope_head_dim


def kv_width(model: ModelConfig, tp: int) -> int:
    """Width of the k (and of the v) a cp rank sends per token: its nh/t heads at W. The up-projected
    per-head K/V, as Megatron-Core's MLA hands its CP attention (multi_latent_attention.py calls
    core_attention on the up-projected query, key, value) and torchtitan's CP rotates; DERIVATIONS.md
    prices the alternative, the (r + dr)-wide latent, which every rank would up-project again."""
    return (model.heads // tp) * kernel_width(model)


def ring_bytes_per_token(model: ModelConfig, tp: int, e: int, latent: bool = False) -> int:
    """Bytes of K/V one token sends per layer per ring hop (forward): the up-projected heads labkit
    sends, 2 (nh/t) W e; or, latent=True, the (r + dr)-wide latent the ring could send instead
    (not built: each rank would up-project every received block with wkv_b again, forward and
    backward, and the latent is whole on every tp rank, so it does not shrink with t)."""
    return (model.kv_lora_rank + model.qk_rope_head_dim) * e if latent else 2 * kv_width(model, tp) * e


def matmul_widths(model: ModelConfig, tp: int) -> list[int]:
    """Output widths of the attention's matmuls in the order they run (torchtitan's per-op policy
    saves every second one): wq_a, wq_b (or wq), wkv_a, wkv_b, wo."""
    nh, dq = model.heads // tp, model.qk_nope_head_dim + model.qk_rope_head_dim
    q = [model.q_lora_rank, nh * dq] if model.q_lora_rank else [nh * dq]
    return (
        q
        + [model.kv_lora_rank + model.qk_rope_head_dim, nh * (model.qk_nope_head_dim + model.v_head_dim)]
        + [model.hidden]
    )
