"""Attention sinks (GPT-OSS; transformers models/gpt_oss `eager_attention_forward`): a learned logit per query
head joins every row's softmax, with no value behind it, softmax([q·k^T / sqrt(hd), sink_h]) minus its last
column. It only adds exp(sink_h) to the denominator, so with the kernel's log-sum-exp L of a row

    out' = out · exp(L - L'),  L' = log(exp(L) + exp(sink_h))      (the kernel's output, rescaled)

and the flash backward fed (out', L') is the sinked attention's own (its P' = exp(S - L'), its D = rowsum(dO·out'),
the sink's column carrying no value); the sink's gradient is -Σ_rows exp(sink_h - L') · rowsum(dO·out'). So a
layer keeps what PyTorch's CPU flash kernel keeps, q, k, v, out', L' (and a window's additive mask), as the
theory counts SDPA's. On a device without that kernel `sink_attention` (engines/layers.py) computes the same
eagerly, keeping the (s, s) probabilities too.
"""

from __future__ import annotations

import torch


class SinkFlash(torch.autograd.Function):
    """forward: CPU flash attention with each head's sink in the denominator; backward: the flash backward
    on (out', L') and the sinks' gradient. q (b, nh, s, hd), k and v (b, nkv, s, hd), sinks (nh,),
    mask: an additive (s, s) mask in q's dtype, or None for plain causal."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is None, attn_mask=mask
        )  # (b, nh, s, hd), (b, nh, s) fp32
        lse_all = torch.logaddexp(lse, sinks.float().view(1, -1, 1))  # L' (b, nh, s)
        out = out * torch.exp(lse - lse_all).unsqueeze(-1).to(out.dtype)  # rows shrunk by the sink's share
        ctx.save_for_backward(q, k, v, out, lse_all, *(() if mask is None else (mask,)))
        ctx.sinks = sinks  # a parameter: read in backward, not a saved activation
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_all, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse_all, 0.0, mask is None, attn_mask=mask
        )
        rows = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO · out') (b, nh, s)
        share = torch.exp(ctx.sinks.float().view(1, -1, 1) - lse_all)  # the sink's probability per row
        dsinks = -(share * rows).sum(dim=(0, 2))  # (nh,)
        return dq, dk, dv, dsinks.to(ctx.sinks.dtype), None


def sink_flash(q, k, v, sinks, window_mask: torch.Tensor | None) -> torch.Tensor:
    """SinkFlash with a boolean (s, s) window mask made additive in q's dtype (as SDPA's CPU path makes it)."""
    mask = None
    if window_mask is not None:
        mask = torch.zeros(window_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~window_mask, float("-inf"))
    return SinkFlash.apply(q, k, v, sinks, mask)
