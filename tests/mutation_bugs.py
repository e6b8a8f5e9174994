"""The bugs tests/test_mutations.py plants in the real strategies: each the original function or method
with one thing wrong, written out beside what it changes (make(original) -> the mutated one)."""

from __future__ import annotations

STEPS = 2
"""The steps every mutated run takes: the bugs that act at the last step read it."""


def bucket_never_reduced(original):
    """engines/parallel/ddp.py DDP._launch_ready, with bucket 2's all-reduce left out."""
    import torch.distributed as dist

    def _launch_ready(self, all_remaining=False):
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if b.pending > 0 and not all_remaining:
                return
            if self.next_launch != 2 and dist.get_world_size(b.group) > 1:
                b.work = dist.all_reduce(b.buffer, group=b.group, async_op=True)
            self.next_launch += 1

    return _launch_ready


def summed_not_averaged(original):
    """DDP.finish without the division by the loss shards."""

    def finish(self):
        self.loss_shards = 1
        return original(self)

    return finish


def row_parallel_not_reduced(original):
    """engines/parallel/tensor/ RowParallelLinear.forward without g (the partial sums stay partial)."""
    import torch.nn.functional as F

    def forward(self, x):
        return F.linear(x, self.weight)

    return forward


def copy_grad_not_reduced(original):
    """engines/parallel/tensor/ops.py Copy.backward (f's backward) without its all-reduce: the gradient into
    a replicated input (a norm's output, read by every tp rank's slice) stays this rank's partial sum."""

    def backward(ctx, grad):
        return grad, None

    return backward


def sequence_not_gathered(original):
    """tensor.py Gather.forward (SP's entry) without its all-gather: this rank's s/t rows stand in
    for every rank's (shapes hold, so the run goes on)."""
    import torch.distributed as dist

    def forward(ctx, x, group):
        ctx.group = group
        return x.repeat(1, dist.get_world_size(group), 1)  # (b, s/t, h) -> (b, s, h)

    return forward


def shard_off_by_one(original):
    """engines/parallel/zero.py ZeRO12.finish, each gradient shard then read one element late."""

    def finish(self):
        original(self)
        for g in self.grads:
            g.copy_(g.roll(1))

    return finish


def stale_gather(original):
    """engines/parallel/zero3.py ZeRO3._free that frees nothing: the gathered parameters stay, and
    the next forward (after the update) uses them instead of gathering the new ones."""

    def _free(self, u):
        pass

    return _free


def replica_drifts_at_the_end(original):
    """DDP.step, after which rank 3 nudges one element of one replica in the last step."""
    import torch
    import torch.distributed as dist

    def step(self):
        norm = original(self)
        if dist.get_rank() == 3 and self.opt.t == STEPS:
            with torch.no_grad():
                self.masters[4].view(-1)[7] += 1e-6  # blocks.0.attn.wq.weight
        return norm

    return step


def wrong_microbatch(original):
    """engines/parallel/pipeline/ PipelineExecutor._tag: the receiving stage asks for another
    microbatch's activations (tags pair a send with its receive)."""

    def _tag(self, a):
        if a.op == "recv_act":
            a = a._replace(mb=self.table.m - 1 - a.mb)
        return original(self, a)

    return _tag


def unmasked_ring_block(original):
    """engines/parallel/context/ _scores: on rank 0 the diagonal blocks lose their causal mask."""
    import torch.distributed as dist

    def _scores(q, k, causal, scale):
        return original(q, k, causal and dist.get_rank() != 0, scale)

    return _scores


def gathered_dkv_kept_home(original):
    """engines/parallel/context/kinds.py reduce_scatter_single, which hands each cp rank its own part
    of the K/V gradients without the other ranks' (the all-gather kind's reduce-scatter skipped)."""
    import torch.distributed as dist

    def reduce_scatter_single(output, input, group=None, async_op=False):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        output.copy_(input.view(n, -1)[r])

    return reduce_scatter_single


def heads_sent_reversed(original):
    """engines/parallel/context/kinds.py _to_heads, whose all-to-all sends the heads in reverse order."""

    def _to_heads(x, group, cp):
        return original(x.flip(2), group, cp)

    return _to_heads


def run_chunks_swapped(original):
    """engines/parallel/context/kinds.py zigzag_chunks, which the hierarchical kind's ring reads
    for each run's chunks: each rank's two chunks listed the wrong way round."""

    def zigzag_chunks(rank, cp):
        return original(rank, cp)[::-1]

    return zigzag_chunks


def tokens_to_the_wrong_rank(original):
    """engines/parallel/experts.py ExpertParallel.__call__, whose combine swaps the last row bound
    for source rank 0 with the first bound for rank 1."""
    import torch
    import torch.distributed as dist

    from labkit.engines.parallel.experts import _AllToAll

    def __call__(self, moe, rows, counts):
        ep, local = self.ep, self.local
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        got = got.view(ep, local)
        send = counts.view(ep, local).sum(dim=1).tolist()
        recv = got.sum(dim=1).tolist()
        arrived = _AllToAll.apply(rows, recv, send, self.group)
        pieces = arrived.split(got.flatten().tolist())
        outs = [moe.expert(e, torch.cat([pieces[src * local + e] for src in range(ep)])) for e in range(local)]
        parts = [o.split(got[:, e].tolist()) for e, o in enumerate(outs)]
        back = torch.cat([parts[e][src] for src in range(ep) for e in range(local)])
        if recv[0] and recv[1]:  # the bug: one token's result to each other's rank
            order = list(range(back.shape[0]))
            order[recv[0] - 1], order[recv[0]] = recv[0], recv[0] - 1
            back = back[order]
        return _AllToAll.apply(back, send, recv, self.group)

    return __call__


def clipping_skipped_on_rank_1(original):
    """DDP.step, which on rank 1 updates with the unclipped gradients."""
    import torch.distributed as dist

    from labkit.engines.optim import grad_norm
    from labkit.engines.precision import copy_masters

    def step(self):
        if dist.get_rank() != 1:
            return original(self)
        grads = [p.grad for p in self.params]
        norm = grad_norm(grads, self.counted, self.norm_group)
        self.opt.step(grads, 1.0)  # the bug: no clip_coefficient(norm, clip)
        copy_masters(self.params, self.masters)
        for b in self.buckets:
            b.buffer.zero_()
        return float(norm)

    return step


def nan_on_rank_2(original):
    """DDP.finish, after which a NaN appears in one gradient of rank 2 in the last step."""
    import torch.distributed as dist

    def finish(self):
        original(self)
        if dist.get_rank() == 2 and self.opt.t == STEPS - 1:
            self.params[4].grad.view(-1)[0] = float("nan")

    return finish


def padding_in_the_loss(original):
    """engines/loss.py MaskPadding.forward without the mask: the padding logits (0) join the softmax."""

    def forward(ctx, logits, valid):
        return logits.clone()

    return forward


def replicas_not_reduced(original):
    """engines/parallel/shards.py all_reduce_replicas doing nothing: HSDP's halves of dp never sum
    their reduced shards, each trains on its own samples."""

    def all_reduce_replicas(shard, group):
        return None

    return all_reduce_replicas


def norm_over_every_replica(original):
    """engines/parallel/common.py norm_terms summing the squares over the whole dp under HSDP: each
    shard counted once per replica (dp_replicate times), the norm sqrt(2) too large."""

    def norm_terms(records, mesh, sharded=False):
        group, counted = original(records, mesh, sharded)
        split = tuple(d for d in ("tp", "pp", "ep", "dp", "cp") if mesh.size(d) > 1)
        return mesh.group(*split), counted

    return norm_terms


def norm_grads_halved(original):
    """DDP.finish, after which every norm's gradient is halved (a LayerNorm's weight and bias)."""

    def finish(self):
        original(self)
        for n, p in zip(self.names, self.params):
            if ".ln" in n or "head.norm" in n:
                p.grad.mul_(0.5)

    return finish


def projections_never_produced(original):
    """DDP.finish, after which attention's query and key projections have no gradient (zeros)."""

    def finish(self):
        original(self)
        for n, p in zip(self.names, self.params):
            if "attn.wq" in n or "attn.wk" in n:
                p.grad.zero_()

    return finish


def fc1_scaled(original):
    """DDP.finish, after which the MLP's first layer's gradients are 0.8 of what they are."""

    def finish(self):
        original(self)
        for n, p in zip(self.names, self.params):
            if "mlp.fc1" in n:
                p.grad.mul_(0.8)

    return finish


def averaged_twice(original):
    """DDP.finish dividing by the loss shards and then by two once more: every gradient halved."""

    def finish(self):
        original(self)
        for p in self.params:
            p.grad.div_(2)

    return finish


def converts_nothing(original):
    """engines/float8.py convert as engines/parallelize.py calls it, converting no layer: the run computes in
    bf16 while it says fp8."""

    def convert(model, recipe):
        return []

    return convert


def torch_ddp_summed(original):
    """engines/parallel/ddp.py TorchDDP.__init__, whose PyTorch DDP gets a communication hook that sums the
    ranks' gradients and never divides (DDP's own hook divides by the group's size first)."""
    import torch.distributed as dist

    def summed(group, bucket):
        fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def __init__(self, module, group, metas, bucket_mb, optim):
        original(self, module, group, metas, bucket_mb, optim)
        self.ddp.register_comm_hook(group, summed)

    return __init__


def fsdp2_computes_in_fp32(original):
    """engines/parallel/fsdp.py TorchFSDP.__init__ handing PyTorch's FSDP2 an fp32 compute dtype: no
    MixedPrecisionPolicy, the run computes in fp32 while it says bf16."""
    from dataclasses import replace

    import torch

    def __init__(self, model, mesh, reshard, pol, *args, **kwargs):
        original(self, model, mesh, reshard, replace(pol, compute=torch.float32), *args, **kwargs)

    return __init__
