"""Tensor parallelism (Megatron-LM) and sequence parallelism, labkit's own.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3: split each MLP's first weight by columns and its second by
rows, so the GELU between them needs no communication; split attention by heads (wq, wk, wv
column-parallel, wo row-parallel). Two conjugate operators join the pieces: f (identity
forward, all-reduce backward) where a replicated activation enters a parallel region, g
(all-reduce forward, identity backward) where the partial outputs leave it: per layer two
all-reduces of (b, s, h) forward and two backward. The embedding and the LM head are split
along the vocabulary; the cross-entropy runs on the logit shards (the (b, s, V) logits are
never gathered).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
section 4.2.2: between the parallel regions (LayerNorms, residual adds; dropout elsewhere)
every rank repeats the same work on the same (b, s, h) tensor. Sequence parallelism shards
those regions along the sequence: g becomes an all-gather along the sequence (forward;
reduce-scatter backward) and the closing all-reduce becomes a reduce-scatter (forward;
all-gather backward). An all-reduce is a reduce-scatter plus an all-gather, so the bytes are
the same; the LayerNorm inputs and the residual stream shrink to s/t rows.

Where this differs from Megatron: wq, wk and wv stay separate Linear layers (Megatron fuses
them), so the input operator sits once at the input of the attention / MLP (a forward
pre-hook named in the plan), not inside each linear layer. And under SP the column-parallel
layers keep their gathered input for backward; Megatron keeps the s/t shard and all-gathers
it again in backward, trading two more all-gathers per layer for 2bsh(1 - 1/t) bytes
(labkit/theory/tensor.py gives both).

MoE layers are replicated over tp (ARCHITECTURE.md says why): no f or g around them, and under
SP an all-gather in (`GatherReplicated`) and a slice out (`Split`).

The plan (plans/tensor.py) is data; `apply_tp` walks it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.plans.mesh import DATA_DIMS
from labkit.plans.tensor import local_param, tp_plan


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
    return out


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
    target's logit — backward none (softmax minus one-hot, on this rank's vocabulary slice)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        n, v = logits.shape  # this rank: vocabulary [start, start + v)
        top = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # (N,) max over the whole vocabulary
        shifted = logits - top[:, None]  # (N, V/t)
        outside = (targets < start) | (targets >= start + v)  # (N,) target held by another rank
        local = (targets - start).masked_fill(outside, 0)  # (N,)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # (N, V/t)
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # (2, N)
        dist.all_reduce(sums, group=group)  # (2, N) summed over tp
        loss = (sums[0].log() - sums[1]).mean()
        ctx.save_for_backward(exp.div_(sums[0][:, None]), local, outside)  # softmax (N, V/t)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        n = softmax.shape[0]
        g = softmax * (grad / n)  # (N, V/t)
        g[torch.arange(n, device=g.device), local] -= (~outside).to(g.dtype) * (grad / n)
        return g, None, None, None


# -- the parallel modules -------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """Y = sum_i X_i B_i: input features split over tp; `leave` sums the partial products
    (all-reduce, or reduce-scatter along the sequence under SP)."""

    def __init__(self, weight: torch.Tensor, leave):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.leave = leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.leave(F.linear(x, self.weight))  # (b, s, in/t) -> (b, s, out) partial -> summed


class VocabParallelEmbedding(nn.Module):
    """Token table split along the vocabulary (rows [start, start + V/t)), plus the replicated
    position embedding. Tokens another rank owns look up zeros; `leave` sums the partial
    lookups. Under SP the sum lands sequence-sharded and each rank adds its s/t positions."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding, start: int, leave, seq_chunk=None):
        super().__init__()
        self.tok, self.pos, self.start, self.leave = tok, pos, start, leave
        self.seq_chunk = seq_chunk  # (tp rank, tp) under SP, else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        v = self.tok.weight.shape[0]
        outside = (tokens < self.start) | (tokens >= self.start + v)  # (b, s)
        x = F.embedding((tokens - self.start).masked_fill(outside, 0), self.tok.weight)  # (b, s, h)
        x = self.leave(x.masked_fill(outside[..., None], 0.0))  # (b, s, h) partial -> summed (or s/t rows)
        if self.seq_chunk is not None:
            r, t = self.seq_chunk
            positions = positions.reshape(t, -1)[r]  # (s,) -> (s/t,) this rank's rows
        return x + self.pos(positions)


class VocabParallelHead(nn.Module):
    """Final LayerNorm, the LM head split along the vocabulary, and the vocab-parallel loss."""

    def __init__(self, norm: nn.LayerNorm, proj: nn.Linear, start: int, enter, group):
        super().__init__()
        self.norm, self.proj, self.start, self.enter, self.group = norm, proj, start, enter, group

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.enter(self.norm(x))  # (b, s, h) on every tp rank
        logits = self.proj(x)  # (b, s, h) -> (b, s, V/t)
        # the loss is taken in fp32 whatever the compute precision
        return VocabParallelCrossEntropy.apply(logits.float().flatten(0, 1), targets.flatten(), self.start, self.group)


# -- applying the plan ----------------------------------------------------------------------
def _sliced(weight: torch.Tensor, box) -> nn.Parameter:
    """This rank's slice of a full (seeded) weight, as a parameter with storage of its own."""
    return nn.Parameter(weight.detach()[tuple(slice(a, b) for a, b in box)].clone())


def apply_tp(model: nn.Module, mesh, *, sequence_parallel: bool) -> tuple[nn.Module, dict]:
    """Slice the full, seeded `model` for this tp rank as the plan says (on the mesh's tp group);
    returns (model, the plan as data for the report).

    Sliced parameters get `_lk_full_shape` / `_lk_box`; replicated ones `_lk_replicas=('tp',)`,
    and under SP `_lk_reduce` gains 'tp' (each rank saw s/t positions: partial gradients)."""
    group, t, r = mesh.group("tp"), mesh.size("tp"), mesh.coord("tp")
    plan = tp_plan(model.cfg, sequence_parallel)
    ops = {
        "copy": lambda x: Copy.apply(x, group),
        "all-gather": lambda x: Gather.apply(x, group),
        "all-reduce": lambda x: Reduce.apply(x, group),
        "reduce-scatter": lambda x: Scatter.apply(x, group),
        "all-gather-replicated": lambda x: GatherReplicated.apply(x, group),
        "split": lambda x: Split.apply(x, group),
    }
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}

    for name, style in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr)
        kind = style["style"]
        if "shard_dim" in style:
            _, box, _, _ = local_param(plan, name + ".weight", full[name + ".weight"], t, r)
            weight = _sliced(module.weight, box)
        if kind == "colwise":
            module.weight, module.out_features = weight, weight.shape[0]
        elif kind == "rowwise":
            setattr(parent, attr, RowParallelLinear(weight, ops[style["output"]]))
        elif kind == "vocab" and isinstance(module, nn.Embedding):
            module.weight, module.num_embeddings = weight, weight.shape[0]
            chunk = (r, t) if plan[parent_name + ".pos"]["style"] == "sequence" else None
            model.set_submodule(
                parent_name, VocabParallelEmbedding(module, parent.pos, box[0][0], ops[style["output"]], chunk)
            )
        elif kind == "vocab":
            module.weight, module.out_features = weight, weight.shape[0]
            model.set_submodule(
                parent_name, VocabParallelHead(parent.norm, module, box[0][0], ops[style["input"]], group)
            )
        elif kind == "input":
            enter = ops[style["input"]]
            module.register_forward_pre_hook(lambda _m, args, enter=enter: (enter(args[0]), *args[1:]))
        elif kind == "replicate" and "input" in style:  # an MoE layer under SP (plans/tensor.py)
            enter, leave = ops[style["input"]], ops[style["output"]]
            module.register_forward_pre_hook(lambda _m, args, enter=enter: (enter(args[0]), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out, leave=leave: leave(out))

    for name, p in model.named_parameters():
        _, box, extra, replicas = local_param(plan, name, full[name], t, r)
        if box is not None:
            p._lk_full_shape, p._lk_box = full[name], box
        else:
            p._lk_replicas = replicas
            if extra:
                p._lk_reduce = DATA_DIMS + extra
    return model, plan
