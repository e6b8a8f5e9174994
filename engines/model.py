"""The model: embedding, pre-norm blocks, final norm and LM head, for three families
(ModelConfig.arch), readable top to bottom like nanoGPT; the blocks' parts are in
engines/layers.py.

  gpt    labkit's toy: learned positions, LayerNorm, exact-GELU MLP, no biases, untied head
  gpt2   GPT-2 (Radford et al. 2019): the same with biases everywhere, tanh GELU, tied head
  llama  Llama 2/3 (Touvron et al. 2023; Llama Team 2024), Mistral: RMSNorm, rotary positions,
         SwiGLU MLP, grouped-query attention, no biases; with experts, Mixtral (Jiang et al. 2024)
  deepseek_v3  DeepSeek-V3 (arXiv 2412.19437): llama's blocks with multi-head latent attention
         (engines/mla.py) and its YaRN RoPE; its first dense_layers blocks dense, the rest MoE
         (engines/moe.py: sigmoid router, shared experts, group-limited routing)
  gemma3  Gemma 3's text model: (1 + w) RMSNorms before and after each sublayer, GeGLU, a
         sqrt(h)-scaled tied embedding, local sliding-window and global layers (engines/layers.py)

The parts are separate modules so that strategies can work on them by function, never by
subclassing: tensor parallelism swaps the Linear layers of `attn` and `mlp`, context
parallelism swaps `attn.core` (the attention kernel), the pipeline splits `embed`, `blocks`
and `head` across stages.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from labkit.config import ModelConfig
from labkit.engines.layers import MLP, Attention, Rotary, SwiGLU, norm, scaled
from labkit.engines.loss import cross_entropy, mask_padding
from labkit.engines.mla import LatentAttention, LatentRotary
from labkit.engines.moe import MoE


class Embedding(nn.Module):
    """Token embedding, plus a learned absolute position embedding (gpt, gpt2; llama rotates q and
    k instead: engines/layers.py)."""

    def __init__(self, cfg: ModelConfig, rows: int):
        super().__init__()
        self.tok = nn.Embedding(rows, cfg.hidden)  # rows: the vocabulary, padded (ModelConfig.padded_vocab)
        self.pos = None if cfg.family.rotary else nn.Embedding(cfg.seq, cfg.hidden)
        # Gemma: times sqrt(h), a float (a buffer would be a state the strategies must carry); TP's
        # VocabParallelEmbedding reads it too
        self.scale = math.sqrt(cfg.hidden) if cfg.family.scaled_embedding else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # (b, s) tokens, (s,) positions -> (b, s, h)
        x = scaled(self.tok(tokens), self.scale)
        return x if self.pos is None else x + self.pos(positions)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); Gemma's four norms:
    x + ln1_post(attn(ln1(x))), then x + ln2_post(mlp(ln2(x))) (HF's post_attention_layernorm,
    pre_feedforward_layernorm and post_feedforward_layernorm are ln1_post, ln2 and ln2_post).
    `layer`: the block's index, which decides its attention's window and RoPE (ModelConfig.layer_*)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = LatentAttention(cfg) if cfg.family.latent_attention else Attention(cfg, layer)
        self.ln2 = norm(cfg)
        if cfg.moe_layer(layer):  # the first dense_layers blocks stay dense (DeepSeek-V3's first_k_dense_replace)
            self.mlp = MoE(cfg, layer)
        elif cfg.family.gated_mlp:
            self.mlp = SwiGLU(cfg)
        else:
            self.mlp = MLP(cfg)
        # registered after the MLP, so every older family's parameter order is unchanged
        self.ln1_post = norm(cfg) if cfg.family.sandwich_norm else None
        self.ln2_post = norm(cfg) if cfg.family.sandwich_norm else None

    def forward(self, x: torch.Tensor, rope: tuple | dict | None = None) -> torch.Tensor:
        y = self.attn(self.ln1(x), rope)
        x = x + (y if self.ln1_post is None else self.ln1_post(y))
        y = self.mlp(self.ln2(x))
        return x + (y if self.ln2_post is None else self.ln2_post(y))


class Head(nn.Module):
    """Final norm, LM head and the mean cross-entropy over every token. A tied head's weight is
    the token embedding's (GPT.__init__ ties it). Of its `rows` outputs the first `vocab` are
    tokens; the rest (a padded vocabulary) are masked out of the loss."""

    def __init__(self, cfg: ModelConfig, rows: int):
        super().__init__()
        self.norm = norm(cfg)
        self.proj = nn.Linear(cfg.hidden, rows, bias=False)
        self.loss, self.vocab = cfg.loss, cfg.vocab

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = mask_padding(self.proj(self.norm(x)), self.vocab)  # (b, s, h) -> (b, s, V padded)
        return cross_entropy(logits, targets, self.loss)


class GPT(nn.Module):
    """The decoder of every family (ModelConfig.arch). Positions come with the tokens: the whole
    sequence by default, a context-parallel rank's zigzag positions under CP. `rows`: the
    embedding's and the head's, the vocabulary padded for a layout (ModelConfig.padded_vocab;
    default unpadded, the one-process reference's)."""

    def __init__(self, cfg: ModelConfig, rows: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg, rows or cfg.vocab)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.head = Head(cfg, rows or cfg.vocab)
        self.rope = Rotary(cfg) if cfg.family.rotary else None
        if cfg.family.latent_attention:  # MLA rotates qk_rope_head_dim dims, with YaRN
            self.rope = LatentRotary(cfg)
        if cfg.tied:  # one Parameter: named_parameters lists it once, as embed.tok.weight
            self.head.proj.weight = self.embed.tok.weight

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean LM loss over (b, s) tokens, plus the MoE load-balancing loss when there are experts."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens, positions)
        rope = self.rope(positions, x.dtype) if self.rope is not None else None  # 2 x (s, hd), shared by the blocks
        for block in self.blocks:
            x = block(x, rope)
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
    (attn.wo, mlp.fc2 / mlp.down and the experts' second layer) scaled by 1/sqrt(2 * layers);
    norm weights 1, biases 0. Every layout initialises the full model this way and then
    slices it, so every layout starts from the same weights. A padded vocabulary's rows beyond
    `vocab` start at zero, drawn from nothing: the random stream is the unpadded model's.
    """
    gen = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * model.cfg.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln" in name or "norm." in name:  # Gemma's (1 + w) norms start at w = 0
                p.fill_(1.0 if name.endswith("weight") and not model.cfg.family.offset_norm else 0.0)
            elif name.endswith("bias"):  # gpt2's and Qwen2's Linear biases
                p.zero_()
            else:
                std = resid if name.endswith(("wo.weight", "fc2.weight", "down.weight", "w2")) else 0.02
                rows = model.cfg.vocab if name in ("embed.tok.weight", "head.proj.weight") else p.shape[0]
                p.zero_()  # the padding rows, if any (a vocab table's rows beyond vocab)
                p[:rows].copy_(torch.randn((rows, *p.shape[1:]), generator=gen) * std)
    return model


def build_model(cfg: ModelConfig, seed: int, tp: int | None = None) -> GPT:
    """The full model, initialised from `seed`, in fp32 on the CPU. `tp`: its vocabulary padded as
    a `tp`-way layout pads it (ModelConfig.padded_vocab); None: unpadded, the reference's model."""
    return init_weights(GPT(cfg, None if tp is None else cfg.padded_vocab(tp)), seed)
