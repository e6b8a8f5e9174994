"""The parts a block is made of, for each model family (engines/model.py puts them together):
attention (multi-head or grouped-query, with rotary positions for llama), the two MLPs (GELU,
SwiGLU), the norms, and the rotary tables. Readable top to bottom, shapes on every reshape.

Rotary position embeddings (Su et al., "RoFormer", 2021): each pair of a head's dimensions
(i, i + hd/2) is rotated by the angle position · θ^(-2i/hd), in the half-split layout of Hugging
Face's Llama (`rotate_half`), so q·k depends on the distance between the positions only. The
tables are computed in fp32 from the positions the model is given — a context-parallel rank's
zigzag positions, the whole sequence otherwise (under SP attention runs on the gathered
sequence) — and cast to the compute dtype, as HF does.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig


def rope_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """θ^(-2i/hd) for i < hd/2, fp32 (hd/2,); with Llama 3.1's scaling (HF
    `_compute_llama3_parameters`, Meta's `apply_scaling`): wavelengths 2π/f beyond
    original/low_freq_factor are divided by `factor`, those below original/high_freq_factor kept,
    and in between f is interpolated: (1 - w) f/factor + w f, w = (original/λ - low) / (high - low)."""
    hd = cfg.head_dim
    freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    sc = cfg.rope_scaling
    if sc is None:
        return freq
    wavelen = 2 * math.pi / freq
    low_wavelen = sc.original_max_position / sc.low_freq_factor
    high_wavelen = sc.original_max_position / sc.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, freq / sc.factor, freq)
    w = (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smooth = (1 - w) * scaled / sc.factor + w * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, smooth, scaled)


class Rotary(nn.Module):
    """(cos, sin) tables for the positions of a forward; no parameters, no buffers (a bf16 copy of
    the model must not round the frequencies)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freq = rope_frequencies(self.cfg, positions.device)  # (hd/2,)
        angles = positions.float()[:, None] * freq[None, :]  # (s,) x (hd/2,) -> (s, hd/2)
        angles = torch.cat([angles, angles], dim=-1)  # (s, hd): both halves of each pair
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x (b, nh, s, hd) rotated by the tables (s, hd): x cos + rotate_half(x) sin."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (x1, x2) -> (-x2, x1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal softmax attention. q (b, nh, s, hd), k and v (b, nkv, s, hd) -> (b, nh, s, hd).
    With fewer KV heads, query head i reads KV head i // (nh / nkv) (grouped-query attention)."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Causal self-attention with `heads` query heads and `n_kv_heads` key/value heads; head counts
    are read off the projections' widths, so a TP shard works as is. gpt2 has biases on every
    projection, Qwen2 on q, k and v; llama rotates q and k."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, kv = cfg.hidden, cfg.n_kv_heads * cfg.head_dim
        bias = cfg.family.biases
        qkv_bias = bias or cfg.qkv_bias
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(h, h, bias=qkv_bias)
        self.wk = nn.Linear(h, kv, bias=qkv_bias)
        self.wv = nn.Linear(h, kv, bias=qkv_bias)
        self.wo = nn.Linear(h, h, bias=bias)
        self.core = causal_attention  # swapped for ring attention under context parallelism

    def forward(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        # (b, s, h) -> (b, s, nh, hd) -> (b, nh, s, hd); nh, nkv are the local head counts under TP
        q = self.wq(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, hd).transpose(1, 2)  # (b, nkv, s, hd)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope)
        y = self.core(q, k, v)  # (b, nh, s, hd)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, nh*hd)
        return self.wo(y)  # (b, s, h)


class MLP(nn.Module):
    """gpt: fc2(GELU(fc1 x)), no biases; gpt2: with biases and the tanh GELU ('gelu_new')."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        bias = cfg.family.biases
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=bias)
        self.approximate = cfg.family.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))  # (b, s, h) -> (b, s, f) -> (b, s, h)


class SwiGLU(nn.Module):
    """llama: down(SiLU(gate x) * up x) (Shazeer, "GLU Variants Improve Transformer", 2020)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (b, s, h) -> 2 x (b, s, f) -> (b, s, h)


def norm(cfg: ModelConfig) -> nn.Module:
    """RMSNorm (Zhang & Sennrich 2019; weight only) for llama, LayerNorm (weight and bias) otherwise."""
    if cfg.family.rms_norm:
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
