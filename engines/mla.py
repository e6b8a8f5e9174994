"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3, arXiv
2412.19437, section 2.1.1, eqs. 1-11) and its YaRN RoPE: arch 'deepseek_v3' (engines/model.py).
The weights' shapes are labkit/config/latent.py's `mla_shapes`; the names DeepSeek's own
inference/model.py's (transformers' in the docstring there).

    c_q  = q_norm(wq_a x)                (b, s, q_lora_rank)      queries' latent (or q = wq x)
    q    = wq_b c_q -> [q_nope | q_pe]    (b, nh, s, dn + dr)      q_pe rotated per head
    [c_kv | k_pe] = wkv_a x               (b, s, r + dr)           k_pe: ONE rotated key for all heads
    [k_nope | v]  = wkv_b kv_norm(c_kv)   (b, nh, s, dn + dv)
    k    = [k_nope | k_pe]                (b, nh, s, dn + dr)
    y    = wo softmax(q k^T · scale) v

The kernel (`core`, swapped under context parallelism like Attention's) takes q, k and v of one
width: v is zero-padded from dv to dn + dr (the padding's outputs are sliced off; its gradient
is nothing), and q is pre-multiplied so that the kernel's 1/sqrt(width) becomes MLA's scale. So
the ring, all-gather and Ulysses kernels run MLA unchanged and a ring message is the up-projected
per-head K and V (what Megatron-Core's MLA hands its CP attention and torchtitan's SDPA-based CP
rotates), priced in labkit/theory/exact/context.py; DERIVATIONS.md compares it with sending the
(r + dr)-wide latent instead.

RoPE layout: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (its view_as_complex);
transformers computes it on the even/odd slices and writes [rotated evens | rotated odds]
(`apply_rotary_pos_emb_interleave`, rope_interleave=True, the default of every released config).
q_pe and k_pe get the same permutation, so q·k is the interleaved rotation's; labkit does the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig
from labkit.config.latent import LATENT_NORM_EPS, softmax_scale, yarn_gain
from labkit.engines.layers import causal_attention, yarn_frequencies


class LatentRotary(nn.Module):
    """(cos, sin) tables (s, dr) of MLA's rotary part, times YaRN's attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (transformers DeepseekV3RotaryEmbedding's
    `attention_scaling`; 1.0 for DeepSeek-V3's mscale = mscale_all_dim = 1). No parameters, no buffers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gain = yarn_gain(cfg.yarn)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * yarn_frequencies(self.cfg, positions.device)[None, :]  # (s, dr/2)
        return (angles.cos() * self.gain).to(dtype), (angles.sin() * self.gain).to(dtype)


def rotate_interleaved(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (b, n, s, dr), pairs (x0, x1), (x2, x3) ... rotated by the tables (s, dr/2), written
    [rotated evens | rotated odds] (transformers `apply_rotary_pos_emb_interleave`)."""
    cos, sin = rope
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (b, n, s, dr/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LatentAttention(nn.Module):
    """MLA with `heads` heads; the local head count is read off wkv_b's width, so a TP shard (wq_b,
    wkv_b split by heads, wo by its input; the latents' projections and norms whole) works as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, nh, r = cfg.hidden, cfg.heads, cfg.kv_lora_rank
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        dq = self.dn + self.dr
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, nh * dq, bias=False)
        else:
            self.wq = nn.Linear(h, nh * dq, bias=False)
        self.wkv_a = nn.Linear(h, r + self.dr, bias=False)  # [c_kv | k_pe]
        self.kv_norm = nn.RMSNorm(r, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(r, nh * (self.dn + self.dv), bias=False)  # per head [k_nope | v]
        self.wo = nn.Linear(nh * self.dv, h, bias=False)
        self.width = max(dq, self.dv)  # the kernel's one head width (v padded, or q and k if dv > dq)
        # the kernel scales by 1/sqrt(width); q carries the rest of MLA's scale (YaRN's mscale^2 included)
        self.q_gain = softmax_scale(cfg) * math.sqrt(self.width)
        self.window = None  # no sliding window: every layer global (context/kinds.py apply_cp reads it)
        self.core = causal_attention  # swapped for ring attention under context parallelism

    def forward(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        b, s, _ = x.shape
        dn, dr, dv = self.dn, self.dr, self.dv
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)  # (b, s, nh*(dn+dr))
        q = q.view(b, s, -1, dn + dr).transpose(1, 2)  # (b, nh, s, dn+dr); nh local under TP
        nh = q.shape[1]
        q_nope, q_pe = q.split([dn, dr], dim=-1)
        c_kv, k_pe = self.wkv_a(x).split([self.kv_norm.normalized_shape[0], dr], dim=-1)  # (b, s, r), (b, s, dr)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(b, s, nh, dn + dv).transpose(1, 2)  # (b, nh, s, dn+dv)
        k_nope, v = kv.split([dn, dv], dim=-1)
        q_pe = rotate_interleaved(q_pe, rope)
        k_pe = rotate_interleaved(k_pe[:, None], rope).expand(b, nh, s, dr)  # (b, 1, s, dr) -> every head
        q = torch.cat([q_nope, q_pe], dim=-1) * self.q_gain  # (b, nh, s, dn+dr)
        k = torch.cat([k_nope, k_pe], dim=-1)
        q, k, v = (F.pad(t, (0, self.width - t.shape[-1])) for t in (q, k, v))  # (b, nh, s, width)
        # (b, nh, s, W) -> (b, nh, s, dv): the padding's outputs dropped, into a tensor of its own
        # whatever the kernel's layout (a slice could be a view of it or not), so wo keeps e·b·s·nh·dv
        y = self.core(q, k, v).narrow_copy(-1, 0, dv)
        return self.wo(y.transpose(1, 2).reshape(b, s, nh * dv))  # (b, s, nh*dv) -> (b, s, h)
