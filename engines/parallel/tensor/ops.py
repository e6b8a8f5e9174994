"""The communication operators of tensor and sequence parallelism (engines/parallel/tensor/
applies them): each a small autograd.Function whose docstring states forward and backward, in
the words of the papers (Shoeybi et al. 2019, figure 3: f and g; Korthikanti et al. 2022,
section 4.2.2: SP's all-gather and reduce-scatter along the sequence), plus the vocab-parallel
cross-entropy and the gradient sum of a KV head shared by several tp ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.engines.float8 import cast, torchao_float8
from labkit.engines.loss import row_chunks, softmax_grad


# -- collectives along the sequence (dim 1 of (b, s, h)) ------------------------------------
def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/t, h) per rank -> (b, s, h): the chunks in tp-rank order."""
    t = dist.get_world_size(group)
    b, n, h = x.shape
    chunks = x.new_empty(t * b, n, h)
    dist.all_gather_into_tensor(chunks, x.contiguous(), group=group)  # (b, s/t, h) -> (t*b, s/t, h)
    return chunks.view(t, b, n, h).transpose(0, 1).reshape(b, t * n, h)  # (t, b, s/t, h) -> (b, s, h)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) partial sums per rank -> (b, s/t, h): this rank's chunk of their sum."""
    t = dist.get_world_size(group)
    b, s, h = x.shape
    chunks = x.reshape(b, t, s // t, h).transpose(0, 1).contiguous()  # (b, s, h) -> (t, b, s/t, h)
    out = x.new_empty(b, s // t, h)
    dist.reduce_scatter_tensor(out, chunks.view(t * b, s // t, h), group=group)  # -> (b, s/t, h)
    # a view, not `out`: gloo's reduce-scatter Work never reports completion, so the comm meter
    # holds it, and `out` with it, until a sweep; the tensor an autograd.Function returns gets the
    # node as grad_fn, and a graph kept for a split backward's W would live that long
    return out.view_as(out)


# -- the conjugate operators ----------------------------------------------------------------
class Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward (Shoeybi et al., figure 3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # (b, s, h) partial -> summed over tp
        return grad, None


class Reduce(torch.autograd.Function):
    """g: all-reduce forward, identity backward (Shoeybi et al., figure 3)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)  # summed in place: no copy
        dist.all_reduce(x, group=group)  # (b, s, h) partial -> summed over tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Gather(torch.autograd.Function):
    """SP's entry: all-gather along the sequence forward, reduce-scatter backward (Korthikanti, 4.2.2)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)  # (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None  # (b, s, h) -> (b, s/t, h)


class GatherFloat8(torch.autograd.Function):
    """SP's entry in fp8 (torchao's PrepareFloat8ModuleInput, as torchtitan's float8 TP plan uses it):
    forward, the (b, s/t, h) shard cast to e4m3 with the whole sequence's scale (its amax all-reduced,
    MAX) and all-gathered at one byte an element, handed to the colwise layers as an fp8 tensor they
    use and save as is; backward, the bf16 gradient reduce-scattered, as Gather's."""

    @staticmethod
    def forward(ctx, x, group, mm):
        ctx.group = group
        x8 = cast(x, "e4m3", "INPUT", mm, group=group)  # (b, s/t, h) e4m3, the scale of all s rows
        data = all_gather_seq(x8._data.view(torch.uint8), group).view(x8._data.dtype)  # (b, s/t, h) -> (b, s, h)
        tt = torchao_float8().tensor
        return tt.Float8TrainingTensor(data, x8._scale, x.dtype, mm, tt.GemmInputRole.INPUT)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None, None  # (b, s, h) -> (b, s/t, h)


class Scatter(torch.autograd.Function):
    """SP's exit: reduce-scatter along the sequence forward, all-gather backward (Korthikanti, 4.2.2)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)  # (b, s, h) partial -> (b, s/t, h)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None  # (b, s/t, h) -> (b, s, h)


class GatherReplicated(torch.autograd.Function):
    """Into a region every tp rank computes whole and alike (an MoE layer under SP): all-gather
    along the sequence forward; backward keeps this rank's rows of the (replicated) gradient
    (Megatron's gather_from_sequence_parallel_region with tensor_parallel_output_grad=False)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.t = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
        return all_gather_seq(x, group)  # (b, s/t, h) -> (b, s, h)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.t, dim=1)[ctx.rank].contiguous(), None  # (b, s, h) -> (b, s/t, h)


class Split(torch.autograd.Function):
    """Out of such a region: keep this rank's rows forward (no communication), all-gather the
    gradient's rows backward (Megatron's scatter_to_sequence_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, t = dist.get_group_rank(group, dist.get_rank()), dist.get_world_size(group)
        return x.chunk(t, dim=1)[rank].contiguous()  # (b, s, h) -> (b, s/t, h)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None  # (b, s/t, h) -> (b, s, h)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from (N, V/t) logit shards (Megatron-LM's vocab_parallel_cross_entropy):
    forward two all-reduces over tp — the (N,) max, then the (2, N) sum of exponentials with the
    target's logit — backward none (softmax minus one-hot, on this rank's vocabulary slice).
    ModelConfig.loss 'fp32' (logits cast to fp32): the fp32 softmax is kept. 'fused' (logits in
    the compute dtype): they are kept with each row's fp32 log-sum-exp, the softmax is rebuilt
    backward and the gradient written in their dtype, fp32 LOSS_CHUNK logits at a time
    (engines/loss.py)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group, fused=False):
        n, v = logits.shape  # this rank: vocabulary [start, start + v)
        acc = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)
        top = logits.max(dim=-1).values.to(acc)  # (N,)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # (N,) max over the whole vocabulary
        outside = (targets < start) | (targets >= start + v)  # (N,) target held by another rank
        local = (targets - start).masked_fill(outside, 0)  # (N,)
        picked = logits.gather(1, local[:, None]).squeeze(1).to(acc) - top
        target_logit = picked.masked_fill(outside, 0.0)
        if not fused:
            exp = (logits - top[:, None]).exp_()  # (N, V/t)
            sums = torch.stack([exp.sum(dim=-1), target_logit])  # (2, N)
        else:
            sums = torch.empty(2, n, dtype=acc, device=logits.device)
            sums[1] = target_logit
            for a, b in row_chunks(n, v):
                sums[0, a:b] = (logits[a:b].to(acc) - top[a:b, None]).exp_().sum(dim=-1)
        dist.all_reduce(sums, group=group)  # (2, N) summed over tp
        loss = (sums[0].log() - sums[1]).mean()
        ctx.fused = fused
        if not fused:
            ctx.save_for_backward(exp.div_(sums[0][:, None]), local, outside)  # softmax (N, V/t)
        else:
            lse = sums[0].log_() + top  # (N,) log-sum-exp over the whole vocabulary
            ctx.save_for_backward(logits, lse, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad):
        if not ctx.fused:
            softmax, local, outside = ctx.saved_tensors
            n = softmax.shape[0]
            g = softmax * (grad / n)  # (N, V/t)
            g[torch.arange(n, device=g.device), local] -= (~outside).to(g.dtype) * (grad / n)
            return g, None, None, None, None
        logits, lse, local, outside = ctx.saved_tensors
        return softmax_grad(logits, lse, local, grad.to(lse.dtype) / logits.shape[0], ~outside), None, None, None, None


class ReduceGrad(torch.autograd.Function):
    """f on a weight: identity forward, all-reduce of its gradient backward (in fp32, the reduce
    dtype). A KV head shared by tp/kv_heads ranks: each computes the part of its gradient that its
    own query heads cause; the sum over those ranks is the gradient (DERIVATIONS.md)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        total = grad.float().contiguous()  # a copy when the compute dtype is bf16
        dist.all_reduce(total, group=ctx.group)  # (rows, cols) partial -> summed over the KV head's ranks
        return total.to(grad.dtype), None
