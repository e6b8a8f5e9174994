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
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig
from labkit.config.latent import yarn_gain
from labkit.engines.sinks import sink_flash


def rope_frequencies(cfg: ModelConfig, device=None, local: bool = False) -> torch.Tensor:
    """θ^(-2i/hd) for i < hd/2, fp32 (hd/2,); with Llama 3.1's scaling (HF
    `_compute_llama3_parameters`, Meta's `apply_scaling`): wavelengths 2π/f beyond
    original/low_freq_factor are divided by `factor`, those below original/high_freq_factor kept,
    and in between f is interpolated: (1 - w) f/factor + w f, w = (original/λ - low) / (high - low).
    `local`: a sliding-window layer's tables (Gemma 3: base rope_local_theta, unscaled); a global
    layer's are divided by rope_linear_factor (HF `_compute_linear_scaling_rope_parameters`)."""
    hd = cfg.head_dim
    if cfg.yarn is not None:  # GPT-OSS: YaRN over the whole head (MLA's own tables: engines/mla.py)
        return yarn_frequencies(cfg, device, hd)
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    if local:
        return freq
    if cfg.rope_linear_factor != 1.0:
        freq = freq / cfg.rope_linear_factor
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


def yarn_frequencies(cfg: ModelConfig, device=None, dim: int | None = None) -> torch.Tensor:
    """θ^(-2i/dr) for i < dr/2 (dr = qk_rope_head_dim), fp32; with YaRN (transformers
    `_compute_yarn_parameters`, truncate=True; DeepSeek-V3 inference/model.py `precompute_freqs_cis`):
    the dimensions past the correction range [low, high] (wavelengths beyond original / (2π beta_slow))
    divided by `factor`, those before it kept, a linear ramp between. `dim`: the rotated width when it
    is not MLA's (GPT-OSS: head_dim), with the range unrounded when yarn.truncate is False."""
    d, base = dim or cfg.qk_rope_head_dim, cfg.rope_theta
    freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)  # (dr/2,)
    y = cfg.yarn
    if y is None:
        return freq

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times
        return d * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high  # no 0/0 (transformers `linear_ramp_factor`)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return freq / y.factor * ramp + freq * (1 - ramp)  # ramp 0: kept (extrapolated), 1: interpolated


class Rotary(nn.Module):
    """(cos, sin) tables for the positions of a forward; no parameters, no buffers (a bf16 copy of
    the model must not round the frequencies)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """(cos, sin); with a local RoPE base (Gemma 3) a dict of both, {False: global, True: local},
        each layer picking its own (Attention.local)."""
        if self.cfg.rope_local_theta is not None:
            return {local: self.tables(positions, dtype, local) for local in (False, True)}
        return self.tables(positions, dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, local: bool = False):
        freq = rope_frequencies(self.cfg, positions.device, local)  # (hd/2,)
        angles = positions.float()[:, None] * freq[None, :]  # (s,) x (hd/2,) -> (s, hd/2)
        angles = torch.cat([angles, angles], dim=-1)  # (s, hd): both halves of each pair
        if self.cfg.yarn is None:
            return angles.cos().to(dtype), angles.sin().to(dtype)
        gain = yarn_gain(self.cfg.yarn)  # YaRN's attention factor, in fp32 before the cast (as transformers)
        return (angles.cos() * gain).to(dtype), (angles.sin() * gain).to(dtype)


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


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(len q, len k) bool, True where the query may see the key: k <= q, and within the sliding
    window, q - k < window (transformers' causal mask with its sliding_window_overlay)."""
    d = q_pos[:, None] - k_pos[None, :]
    return (d >= 0) if window is None else (d >= 0) & (d < window)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """causal_attention restricted to a sliding window of `window` positions (tokens in order)."""
    pos = torch.arange(q.shape[2], device=q.device)
    mask = window_mask(pos, pos, window)  # (s, s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Causal attention with a learned sink per head (GPT-OSS; transformers `eager_attention_forward`):
    softmax over [q·k^T / sqrt(hd), sink_h], the sink's column dropped, so it only adds exp(sink_h) to
    each row's denominator. q (b, nh, s, hd), k and v (b, nkv, s, hd), sinks (nh,) -> (b, nh, s, hd)."""
    b, nh, s, hd = q.shape
    rep = nh // k.shape[1]  # grouped-query: query head i reads KV head i // rep
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (b, nh, s, hd)
    scores = (q @ k.transpose(2, 3)) * hd**-0.5  # (b, nh, s, s)
    pos = torch.arange(s, device=q.device)
    scores = scores.masked_fill(~window_mask(pos, pos, window), float("-inf"))
    sink = sinks.to(scores.dtype).view(1, nh, 1, 1).expand(b, nh, s, 1)  # (b, nh, s, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # (b, nh, s, s + 1) -> (b, nh, s, s)
    return probs.to(v.dtype) @ v  # (b, nh, s, hd)


class Attention(nn.Module):
    """Causal self-attention with `heads` query heads and `n_kv_heads` key/value heads; head counts
    are read off the projections' widths, so a TP shard works as is. gpt2 has biases on every
    projection, Qwen2 on q, k and v; llama rotates q and k. Block `layer`'s variants:
    q and k normed per head before RoPE (Qwen3, Gemma 3, HF's order), no RoPE on a NoPE layer
    (SmolLM3), a sliding window and a local RoPE base on a local layer (Gemma 3), scores scaled by
    query_pre_attn_scalar^-1/2 (folded into q: every attention core keeps its head_dim^-1/2)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        h, hd = cfg.hidden, cfg.head_dim
        q, kv = cfg.heads * hd, cfg.n_kv_heads * hd  # q is h wide unless kv_channels says otherwise
        bias = cfg.family.biases or cfg.family.attention_biases
        qkv_bias = bias or cfg.qkv_bias
        self.head_dim = hd
        self.wq = nn.Linear(h, q, bias=qkv_bias)
        self.wk = nn.Linear(h, kv, bias=qkv_bias)
        self.wv = nn.Linear(h, kv, bias=qkv_bias)
        self.wo = nn.Linear(q, h, bias=bias)
        # over each head's hd features, one weight for every head: a TP rank holds it whole and its
        # gradient (from the rank's heads only) is summed over tp (layout/tensor.py style 'heads')
        self.q_norm = norm(cfg, hd) if cfg.qk_norm else None
        self.k_norm = norm(cfg, hd) if cfg.qk_norm else None
        self.rotates, self.local = cfg.layer_rotates(layer), cfg.layer_local(layer)
        self.window = cfg.layer_window(layer)  # None: the whole causal prefix
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = None if scalar is None else math.sqrt(hd / scalar)  # hd^-1/2 · q_scale = scalar^-1/2
        # swapped for ring attention under context parallelism (a window exchange on a local layer)
        self.core = causal_attention if self.window is None else partial(windowed_attention, window=self.window)
        # GPT-OSS: one logit per query head, split by heads under TP like wq's rows (transformers' `sinks`)
        self.sinks = nn.Parameter(torch.zeros(cfg.heads)) if cfg.family.sinks else None
        if self.sinks is not None:
            self.core = self.sink_core

    def sink_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention kernel with this layer's sinks and window (a method: the sinks are a parameter):
        PyTorch's CPU flash kernel rescaled (engines/sinks.py) on the CPU, computed eagerly elsewhere."""
        if q.device.type != "cpu":
            return sink_attention(q, k, v, self.sinks, self.window)
        pos = torch.arange(q.shape[2], device=q.device)
        return sink_flash(q, k, v, self.sinks, None if self.window is None else window_mask(pos, pos, self.window))

    def forward(self, x: torch.Tensor, rope: tuple | dict | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.head_dim
        # (b, s, h) -> (b, s, nh, hd) -> (b, nh, s, hd); nh, nkv are the local head counts under TP
        q = self.wq(x).view(b, s, -1, hd)
        k = self.wk(x).view(b, s, -1, hd)  # (b, s, nkv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        if rope is not None and self.rotates:
            tables = rope[self.local] if isinstance(rope, dict) else rope
            q, k = rotate(q, tables), rotate(k, tables)
        if self.q_scale is not None:
            q = q * self.q_scale
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
    """llama: down(SiLU(gate x) * up x) (Shazeer, "GLU Variants Improve Transformer", 2020);
    gemma3: GeGLU, the tanh GELU in SiLU's place (HF hidden_activation 'gelu_pytorch_tanh')."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.act = partial(F.gelu, approximate="tanh") if cfg.family.geglu else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))  # (b, s, h) -> 2 x (b, s, f) -> (b, s, h)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm (transformers' Gemma3RMSNorm): x / rms(x) · (1 + w), in fp32, cast back;
    w starts at 0 (engines/model.py init_weights)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def scaled(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x · scale, the scale rounded to x's dtype first as transformers' Gemma3TextScaledWordEmbedding
    does (sqrt(h) in bf16 is not sqrt(h)); None: x."""
    return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)


def norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """RMSNorm (Zhang & Sennrich 2019; weight only) for llama, Gemma's (1 + w) one for gemma3,
    LayerNorm (weight and bias) otherwise; over `dim` features (default hidden)."""
    dim = dim or cfg.hidden
    if cfg.family.offset_norm:
        return OffsetRMSNorm(dim, cfg.norm_eps)
    if cfg.norms.rms:
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.norms.bias)
