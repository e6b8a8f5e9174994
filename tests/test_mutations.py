"""The oracle cannot be fooled: bugs injected into the real strategies on the real cluster, each of
which `labkit.oracle.checks` must catch, with a message that names the right tensor, rank or step.

A mutation replaces one function or method of a real strategy on every engine for a `with mutated(...)`
block (`lab.apply` ships it by value; the original comes back at the end, whatever happens): nothing in
the code is edited. Each is the original with one bug, written out beside the method it changes. The
layouts run unmutated first and must match (the control): a row is caught by the bug, not the layout.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from conftest import TINY

from labkit import OptimConfig, ParallelConfig, reference
from labkit.config.validation import not_built_yet, problems
from labkit.layout.buckets import grouped_buckets
from labkit.layout.precision import ELEM
from labkit.oracle.arithmetic import arithmetic
from labkit.oracle.checks import margins, mismatches
from labkit.theory.exact.model import param_shapes

STEPS = 2
PRECISIONS = ("fp32", "bf16", "fp8")
"""Every mutation is planted in each (fp8 where the layout runs fp8): the oracle's bounds differ by precision."""
MOE = TINY.replace(experts=4, top_k=2)
PADDED = TINY.replace(vocab=125, vocab_divisible_by=4)
"""TINY on a vocabulary tp=2 cannot split: 128 rows, the last 3 padding (ModelConfig.vocab_divisible_by)."""
BUCKET_MB = 0.02
"""TINY in several DDP buckets (layout/buckets.py); which tensors bucket 2 holds depends on the precision's bytes."""


def skipped(cfg: ParallelConfig) -> tuple[str, ...]:
    """The tensors of the bucket `bucket_never_reduced` leaves out (bucket 2), as the layout buckets them."""
    named = param_shapes(TINY)
    sizes = [math.prod(shape) * ELEM[cfg.precision] for _, shape in named]
    buckets = grouped_buckets(sizes, [None] * len(sizes), int(BUCKET_MB * 2**20))
    return tuple(named[i][0] for i in buckets[2][1])


# -- the hook: patch one attribute on every engine, and put it back -------------------------------
def _patch(module: str, owner: str | None, attr: str, make: Callable) -> None:
    obj = importlib.import_module(module)
    obj = getattr(obj, owner) if owner else obj
    original = vars(obj)[attr]
    static = isinstance(original, staticmethod)
    new = make(original.__func__ if static else original)
    setattr(obj, f"_lk_original_{attr}", original)
    setattr(obj, attr, staticmethod(new) if static else new)


def _restore(module: str, owner: str | None, attr: str) -> None:
    obj = importlib.import_module(module)
    obj = getattr(obj, owner) if owner else obj
    setattr(obj, attr, vars(obj)[f"_lk_original_{attr}"])
    delattr(obj, f"_lk_original_{attr}")


@contextmanager
def mutated(lab, target: tuple[str, str | None, str], make: Callable):
    """`target` (module, class or None, attribute) replaced by make(original) on every engine."""
    lab.apply(lambda: _patch(*target, make))
    try:
        yield
    finally:
        lab.apply(lambda: _restore(*target))


# -- the bugs: each the original with one thing wrong ---------------------------------------------
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


def moments_of_the_next_shard(original):
    """engines/parallel/zero.py ZeRO12.step, which from the second step on updates each shard with the
    next rank's Adam moments (each flat buffer's state gathered and taken one rank round)."""
    import torch
    import torch.distributed as dist

    def step(self):
        opt = self.optimizer.opt
        if opt.t >= 1:
            at = 0
            for layout, (group, n, index) in zip(self.layouts, self.groups):
                k = len(layout.runs(index))
                for state in (opt.exp_avg, opt.exp_avg_sq):
                    mine = torch.cat([s.reshape(-1) for s in state[at : at + k]])
                    every = [torch.empty_like(mine) for _ in range(n)]
                    dist.all_gather(every, mine, group=group) if n > 1 else every.__setitem__(0, mine)
                    theirs, o = every[(index + 1) % n], 0
                    for s in state[at : at + k]:
                        s.copy_(theirs[o : o + s.numel()].view_as(s))
                        o += s.numel()
                at += k
        return original(self)

    return step


def adam_counts_from_two(original):
    """engines/optim.py AdamW.step whose step counter starts one ahead: every bias correction is the next
    step's."""

    def step(self, grads, scale=1.0):
        if self.t == 0:
            self.t = 1
        return original(self, grads, scale)

    return step


def sharded_clip_skipped(original):
    """engines/parallel/shards.py ShardedOptimizer.step, updating every shard with the unclipped gradients."""
    from labkit.engines.optim import grad_norm

    def step(self, grads):
        mine = [
            g[at : at + hi - lo]
            for p, i, g in zip(self.layouts, self.indices, grads)
            for name, _, lo, hi, at in p.pieces(i)
            if self.counted[name]
        ]
        norm = grad_norm(mine, None, self.norm_group)
        runs = [g[lo:hi] for p, i, g in zip(self.layouts, self.indices, grads) for lo, hi, _ in p.runs(i)]
        self.opt.step(runs, 1.0)  # the bug: no clip_coefficient(norm, clip)
        return float(norm)

    return step


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


@dataclass(frozen=True)
class Mutation:
    name: str
    cfg: ParallelConfig
    target: tuple[str, str | None, str]
    make: Callable
    check: str
    """The check that must catch it."""
    names: tuple[str, ...] | Callable
    """What that check's messages must name, each in one of them (a tensor, 'rank r', 'step s'); or a
    function of the layout (with its precision) that says."""
    model: object = TINY
    optim: OptimConfig = OptimConfig()
    precisions: tuple[str, ...] = PRECISIONS
    """The precisions it is planted in, each where labkit builds the layout (`runs`)."""

    def runs(self) -> list[ParallelConfig]:
        """The layout in each of its precisions that labkit builds on the session's 4 engines."""
        out = []
        for p in self.precisions:
            cfg = self.cfg.replace(precision=p)
            if not problems(cfg, self.model, 4) and not not_built_yet(cfg, self.model):
                out.append(cfg)
        return out


E = "labkit.engines.parallel."
DDP4 = ParallelConfig(dp=4, bucket_mb=BUCKET_MB)
FSDP2 = ParallelConfig(dp=4, sharding="fsdp", impl="torch")
MUTATIONS = [
    Mutation("a DDP bucket never reduced", DDP4, (E + "ddp", "DDP", "_launch_ready"), bucket_never_reduced,
             "gradients", skipped),
    Mutation("gradients summed, not averaged", DDP4, (E + "ddp", "DDP", "finish"), summed_not_averaged,
             "gradients", ("every tensor's step 0 reduced gradient is 4 times",)),
    Mutation("TP's row-parallel all-reduce skipped", ParallelConfig(tp=2, dp=2),
             (E + "tensor", "RowParallelLinear", "forward"), row_parallel_not_reduced, "losses", ("step 0",)),
    Mutation("SP's all-gather skipped", ParallelConfig(tp=2, dp=2, sequence_parallel=True),
             (E + "tensor", "Gather", "forward"), sequence_not_gathered, "losses", ("step 0",)),
    Mutation("a ZeRO shard off by one element", ParallelConfig(dp=4, sharding="zero1"),
             (E + "zero", "ZeRO12", "finish"), shard_off_by_one, "gradients", ("embed.tok.weight",)),
    Mutation("ZeRO-3 using stale gathered parameters", ParallelConfig(dp=4, sharding="zero3"),
             (E + "zero3", "ZeRO3", "_free"), stale_gather, "losses", ("step 1",)),
    Mutation("a replica diverging only in the last step", DDP4, (E + "ddp", "DDP", "step"),
             replica_drifts_at_the_end, "replicas", ("blocks.0.attn.wq.weight", "rank 3")),
    Mutation("a pipeline stage receiving the wrong microbatch", ParallelConfig(pp=2, dp=2, microbatches=2),
             (E + "pipeline", "PipelineExecutor", "_tag"), wrong_microbatch, "losses", ("step 0",)),
    Mutation("ring attention without the causal mask on one rank's blocks", ParallelConfig(cp=2, dp=2),
             (E + "context", None, "_scores"), unmasked_ring_block, "losses", ("step 0",)),
    Mutation("all-gather CP's dK/dV not reduce-scattered", ParallelConfig(cp=2, dp=2, cp_kind="allgather"),
             (E + "context.kinds", None, "reduce_scatter_single"), gathered_dkv_kept_home, "gradients",
             ("blocks.1.attn.wv.weight", "blocks.0.attn.wv.weight")),
    Mutation("Ulysses' all-to-all splitting the heads wrongly", ParallelConfig(cp=2, dp=2, cp_kind="ulysses"),
             (E + "context.kinds", None, "_to_heads"), heads_sent_reversed, "losses", ("step 0",)),
    Mutation("hierarchical CP's ring reading a run's chunks in the wrong order",
             ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2), (E + "context.kinds", None, "zigzag_chunks"),
             run_chunks_swapped, "losses", ("step 0",)),
    Mutation("HSDP's replicate all-reduce skipped", ParallelConfig(dp=4, dp_replicate=2, sharding="fsdp"),
             (E + "zero3", None, "all_reduce_replicas"), replicas_not_reduced, "gradients", ("embed.tok.weight",)),
    Mutation("HSDP's norm counted once per replica", ParallelConfig(dp=4, dp_replicate=2, sharding="zero2"),
             (E + "shards", None, "norm_terms"), norm_over_every_replica, "grad norms", ("step 0",)),
    Mutation("an expert's tokens returned to the wrong rank", ParallelConfig(ep=2, dp=2),
             (E + "experts", "ExpertParallel", "__call__"), tokens_to_the_wrong_rank, "losses", ("step 0",), MOE),
    Mutation("gradient clipping skipped on one rank", DDP4, (E + "ddp", "DDP", "step"), clipping_skipped_on_rank_1,
             "replicas", ("rank 1",), optim=OptimConfig(clip=0.5)),
    Mutation("a NaN appearing on one rank", DDP4, (E + "ddp", "DDP", "finish"), nan_on_rank_2, "finite",
             ("rank 2", "step(s) [1]")),
    Mutation("a padded vocabulary's padding logits left in the loss", ParallelConfig(tp=2, dp=2),
             ("labkit.engines.loss", "MaskPadding", "forward"), padding_in_the_loss, "padding",
             ("head.proj.weight", "[125:)"), PADDED),
    Mutation("every norm's gradient halved", DDP4, (E + "ddp", "DDP", "finish"), norm_grads_halved, "gradients",
             ("head.norm.weight: step 0",)),
    Mutation("attention's wq and wk gradients never produced", DDP4, (E + "ddp", "DDP", "finish"),
             projections_never_produced, "gradients", ("blocks.0.attn.wq.weight", "blocks.1.attn.wk.weight")),
    Mutation("the MLP's fc1 gradients 0.8 of themselves", DDP4, (E + "ddp", "DDP", "finish"), fc1_scaled,
             "gradients", ("blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc1.weight")),
    Mutation("every gradient averaged twice (halved)", DDP4, (E + "ddp", "DDP", "finish"), averaged_twice,
             "gradients", ("every tensor's step 0 reduced gradient is 0.5 times",)),
    Mutation("fp8 layers never converted (the run computes in bf16)", DDP4,
             ("labkit.engines.parallelize", None, "convert"), converts_nothing, "float8", ("rank 0", "none ran in fp8"),
             precisions=("fp8",)),
    Mutation("a ZeRO-1 shard stepping with the next shard's Adam moments", ParallelConfig(dp=4, sharding="zero1"),
             (E + "zero", "ZeRO12", "step"), moments_of_the_next_shard, "parameters", ("the final parameters",)),
    Mutation("Adam's step counter one ahead", ParallelConfig(dp=4, sharding="zero2"),
             ("labkit.engines.optim", "AdamW", "step"), adam_counts_from_two, "parameters", ("the final parameters",)),
    Mutation("gradient clipping skipped on a sharded layout, where it binds", ParallelConfig(dp=4, sharding="zero2"),
             (E + "shards", "ShardedOptimizer", "step"), sharded_clip_skipped, "parameters", ("the final parameters",),
             optim=OptimConfig(clip=0.5)),
    Mutation("PyTorch's DDP summing the ranks' gradients, not averaging", ParallelConfig(dp=4, impl="torch"),
             (E + "ddp", "TorchDDP", "__init__"), torch_ddp_summed, "gradients", ("reduced gradient is 4 times",)),
    Mutation("PyTorch's FSDP2 computing in fp32 while it says bf16", FSDP2, (E + "fsdp", "TorchFSDP", "__init__"),
             fsdp2_computes_in_fp32, "gradients", ("step 0's reduced gradient",), precisions=("bf16",)),
]  # fmt: skip
"""OptimConfig(clip=0.5) where clipping must act: TINY's gradient norms are 0.82 to 0.92, under the
default max norm of 1.0."""


@pytest.fixture(scope="module")
def oracle():
    cache = {}

    def get(model, optim):
        if (model, optim) not in cache:
            cache[model, optim] = reference(model, steps=STEPS, optim=optim)
        return cache[model, optim]

    return get


def test_every_mutation_is_caught_and_named(lab, oracle):
    """Each bug in each precision its layout runs (fp32, bf16, fp8): caught, by the check that must catch
    it, naming what it must. The margin printed is the worst bounded check's error over its bound; the
    arithmetic is the reference's (labkit/oracle/arithmetic.py: 'shared' where it computes the run's every
    rounding but its reduction's; else the counted chain's bound, and the fp32 row is the same layout's
    twin, which holds its logic at 1e-5)."""
    rows, honest = [], {}
    for m in MUTATIONS:
        ref = oracle(m.model, m.optim)
        for cfg in m.runs():
            key = (cfg, m.model, m.optim)
            if key not in honest:  # the control: the same layout, unmutated, matches
                res = lab.run(cfg, model=m.model, steps=STEPS, optim=m.optim, return_params=True)
                honest[key] = mismatches(res, ref)
            with mutated(lab, m.target, m.make):
                res = lab.run(cfg, model=m.model, steps=STEPS, optim=m.optim, return_params=True)
            found = mismatches(res, ref)
            kind = "shared" if arithmetic(res).shared else "counted" if cfg.precision != "fp32" else "1e-5"
            expected = [f.message for f in found if f.check == m.check]
            names = m.names(cfg) if callable(m.names) else m.names
            named = expected if all(any(w in x for x in expected) for w in names) else []
            if kind == "counted":  # the chain's bound catches what it can; its fp32 twin's row must name it
                named = [str(f) for f in found]
            rows.append((m, cfg.precision, kind, found, named, margins(res, ref)))
    print(f"\n{'mutation':<64} {'prec':<5} {'bound':<8} {'caught':<7} {'margin':>9}  by (then the first messages)")
    for m, precision, kind, found, named, over in rows:
        checks = list(dict.fromkeys(f.check for f in found))
        # how far past its bound the worst bounded check sits (replicas, finite, padding, routing: exact checks)
        worst = max((v for k, v in over.items() if k != "flips"), default=float("nan"))
        print(
            f"{m.name:<64} {precision:<5} {kind:<8} {'yes' if named else 'NO':<7} {worst:>9.3g}  "
            f"{', '.join(checks) or '-'}"
        )
        for x in (named or [f"{f}" for f in found])[: 3 if named else 12]:
            print(f"{'':<6}{x[:160]}")
    assert {k: v for k, v in honest.items() if v} == {}, "an unmutated layout does not match"
    missed = [f"{m.name} ({precision})" for m, precision, _, _, named, _ in rows if not named]
    assert missed == [], "mutations not caught (or not named)"
    # a layout whose arithmetic no reference shares is held at fp32 too (labkit/oracle/arithmetic.py twin)
    twins = {m.name for m, precision, kind, *_ in rows if kind == "counted"}
    assert twins <= {m.name for m, precision, *_ in rows if precision == "fp32"}, "a counted row without its twin"
    assert {p for _, p, *_ in rows} == set(PRECISIONS), "a precision no mutation ran in"
