"""A small GPT: token + position embedding, pre-LN blocks (causal attention, GELU MLP), final
LayerNorm, untied LM head. Readable top to bottom, like nanoGPT.

The parts are separate modules so that strategies can work on them by function, never by
subclassing: tensor parallelism swaps the Linear layers of `attn` and `mlp`, context
parallelism swaps `attn.core` (the attention kernel), the pipeline splits `embed`, `blocks`
and `head` across stages. Linear layers have no bias (as in Llama), so a row-parallel layer
never has to decide which rank adds it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig
from labkit.engines.moe import MoE


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal softmax attention. q, k, v: (b, nh, s, hd) -> (b, nh, s, hd)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Embedding(nn.Module):
    """Token embedding plus learned absolute position embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # (b, s) tokens, (s,) positions -> (b, s, h)
        return self.tok(tokens) + self.pos(positions)


class Attention(nn.Module):
    """Multi-head causal self-attention; heads are read off wq's width, so a TP shard works as is."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, h, bias=False)
        self.wv = nn.Linear(h, h, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.core = causal_attention  # swapped for ring attention under context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (b, s, h) -> (b, s, nh, hd) -> (b, nh, s, hd); nh is the local head count under TP
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v)  # (b, nh, s, hd)
        y = y.transpose(1, 2).reshape(b, s, -1)  # (b, s, nh*hd)
        return self.wo(y)  # (b, s, h)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (b, s, h) -> (b, s, f) -> (b, s, h)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        if cfg.experts:
            self.mlp = MoE(cfg)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm, LM head and the mean cross-entropy over every token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.proj(self.norm(x))  # (b, s, h) -> (b, s, V)
        # the loss is taken in fp32 whatever the compute precision
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean LM loss over (b, s) tokens, plus the MoE load-balancing loss when there are experts."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x, targets) + aux_loss(self)


def aux_loss(module: nn.Module) -> torch.Tensor | float:
    """Sum of the load-balancing losses the MoE layers inside `module` recorded in this forward,
    times the model's coefficient (0.0 for a dense model)."""
    total = 0.0
    for m in module.modules():
        aux = getattr(m, "aux_loss", None)
        if aux is not None:
            total = total + m.cfg.aux_loss_coef * aux
            m.aux_loss = None
    return total


def init_weights(model: GPT, seed: int) -> GPT:
    """Deterministic init from `seed`, in parameter-name order, independent of any global RNG.

    GPT-2's scheme: N(0, 0.02) for embeddings and matrices, residual output projections
    (attn.wo, mlp.fc2 and the experts' second layer) scaled by 1/sqrt(2 * layers);
    LayerNorm weight 1, bias 0. Every layout initialises the full model this way and then
    slices it, so every layout starts from the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * model.cfg.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or "norm." in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                std = resid if name.endswith(("wo.weight", "fc2.weight", "w2")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """The full model, initialised from `seed`, in fp32 on the CPU."""
    return init_weights(GPT(cfg), seed)
