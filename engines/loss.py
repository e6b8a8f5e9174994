"""The cross-entropy of the LM head, two ways (ModelConfig.loss), the same loss to rounding:

  fp32   F.cross_entropy on the logits cast to fp32 (torchtitan's call): log_softmax keeps its
         fp32 output for backward, 4 bytes a logit; the backward makes fp32 gradients
  fused  one autograd function from the logits in the compute dtype (flash-attn's
         CrossEntropyLoss, llm-foundry's default for MPT; Liger's keeps the same bytes): it keeps
         the logits and each row's fp32 log-sum-exp, e + 4/V bytes a logit, and writes the
         gradient in the compute dtype; fp32 only LOSS_CHUNK logits at a time, forward and back

The vocab-parallel loss under tensor parallelism is engines/parallel/tensor/ops.py's, with the
same two ways. A padded vocabulary (ModelConfig.vocab_divisible_by) has its padding logits set to
-inf first (`mask_padding`), so both ways give the unpadded model's loss and gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.config.choices import Loss, fused_loss
from labkit.layout.precision import LOSS_CHUNK


def row_chunks(rows: int, vocab: int):
    """(start, end) of the row blocks whose logits are at most LOSS_CHUNK elements."""
    step = max(1, LOSS_CHUNK // max(1, vocab))
    return ((i, min(i + step, rows)) for i in range(0, rows, step))


class FusedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of (N, V) logits in their own dtype against (N,) targets."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n, v = logits.shape
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        lse = torch.empty(n, dtype=acc, device=logits.device)
        for a, b in row_chunks(n, v):
            lse[a:b] = torch.logsumexp(logits[a:b].to(acc), dim=-1)  # (rows, V) fp32 -> (rows,)
        picked = logits.gather(1, targets[:, None]).squeeze(1).to(acc)  # (N,) the targets' logits
        ctx.save_for_backward(logits, lse, targets)
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, targets = ctx.saved_tensors
        return softmax_grad(logits, lse, targets, grad.to(lse.dtype) / logits.shape[0]), None


def softmax_grad(logits, lse, targets, scale, held=None) -> torch.Tensor:
    """(softmax(logits) - one_hot(targets)) * scale in the logits' dtype, the softmax rebuilt
    from the rows' log-sum-exp `lse` in its dtype LOSS_CHUNK logits at a time; rows whose `held`
    is False (their target on another rank's vocabulary) get no one-hot."""
    n, v = logits.shape
    out = torch.empty_like(logits)
    for a, b in row_chunks(n, v):
        g = (logits[a:b].to(lse.dtype) - lse[a:b, None]).exp_()  # the rows' softmax
        one = torch.ones(b - a, dtype=g.dtype, device=g.device) if held is None else held[a:b].to(g.dtype)
        g[torch.arange(b - a, device=g.device), targets[a:b]] -= one
        out[a:b] = g.mul_(scale)
    return out


class MaskPadding(torch.autograd.Function):
    """The padding rows' logits (ModelConfig.vocab_divisible_by) out of the loss: forward writes -inf
    to columns [valid:) of the (..., V) logits in place (no copy: the matmul that made them keeps
    only its input); backward identity — every loss here gives a -inf logit exactly zero gradient
    (its softmax is exp(-inf) = 0, and no target is padding), so nothing reaches the padding rows
    (the oracle's padding check holds them at zero)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, valid: int) -> torch.Tensor:
        logits[..., valid:] = float("-inf")  # (..., V): the padding columns
        ctx.mark_dirty(logits)
        return logits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def mask_padding(logits: torch.Tensor, valid: int) -> torch.Tensor:
    """`logits` with columns [valid:) masked (MaskPadding), or as they are when every column is a token."""
    return logits if valid >= logits.shape[-1] else MaskPadding.apply(logits, valid)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, loss: Loss) -> torch.Tensor:
    """Mean cross-entropy of (b, s, V) logits against (b, s) targets, as ModelConfig.loss says."""
    if fused_loss(loss):
        return FusedCrossEntropy.apply(logits.flatten(0, 1), targets.flatten())
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
