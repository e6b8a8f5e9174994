"""The cases tests/test_verify.py and tests/test_verify_mutations.py run lab.verify on: a plain module
(`build`, `batch`, `loss`), the plans that are right, the bugs each a few lines in an otherwise correct plan
(`BUGS`: the plan, the mesh, the options and what the report must say), and how a case runs in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

H, V, S, B = 16, 32, 8, 8  # hidden, vocab, sequence, global batch


class Net(nn.Module):
    """Embedding, a LayerNorm, an MLP, a head: every kind of tensor a TP + SP plan places."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, x):
        h = self.norm(self.emb(x))
        return self.head(h + self.down(F.gelu(self.up(h))))


def build():
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (B, S + 1), generator=g)


def loss(model, b):
    logits = model(b[:, :-1]).float()  # bf16 logits: the loss in fp32, as labkit's engines compute it
    return F.cross_entropy(logits.reshape(-1, V), b[:, 1:].reshape(-1))


def ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, process_group=mesh.get_group("dp"))


def fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.up, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def own_allreduce(model, mesh):
    """The user's own data parallelism: a hook that averages each gradient over the dp group."""
    group = mesh.get_group("dp")
    n = dist.get_world_size(group)

    def average(g):
        g = g / n
        dist.all_reduce(g, group=group)
        return g

    for p in model.parameters():
        p.register_hook(average)
    return model


# -- tensor parallelism with sequence parallelism, and FSDP2 over it ---------------------------------
def sp_plan(norm="norm"):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    # the residual stream between modules: local tensors sharded on the sequence (b, s/tp, h)
    return {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        norm: SequenceParallel(use_local_output=True),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def tp_sp(model, mesh, plan=None):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], plan or sp_plan())
    return fully_shard(model, mesh=mesh["dp"])


def loss_parallel_step(model, b, ctx):
    """The rank step of a plan whose head keeps its vocabulary shards: the loss inside loss_parallel."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        out = ctx.loss(model, ctx.shard(b))
        out.backward()
    return out


def plain_tp(model, mesh, out=None):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    kw = {} if out is None else {"output_layouts": out}
    return parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel(**kw)})


def accumulate(divide: bool, loss_mean: bool = True):
    """A rank step over 2 microbatches of this rank's slice (`loss_mean`: the loss it reports is their mean)."""

    def step(model, b, ctx):
        total = 0.0
        for mb in ctx.shard(b).chunk(2):
            out = ctx.loss(model, mb)
            (out / 2 if divide else out).backward()
            total += out.item() / (2 if loss_mean else 1)
        return total

    return step


# -- the bugs, each a few lines in an otherwise correct plan ----------------------------------
def summed(model, mesh):
    group = mesh.get_group("dp")
    for p in model.parameters():  # the bug: all-reduced (summed), never divided by the dp size
        p.register_hook(lambda g: (dist.all_reduce(g := g.clone(), group=group), g)[1])
    return model


def sp_without_the_norm(model, mesh):
    plan = sp_plan()
    del plan["norm"]  # the bug: the LayerNorm stays a plain tensor, each rank its own tokens' gradient
    return tp_sp(model, mesh, plan)


def same_batch(model, b, ctx):
    from labkit.engines.verify import slice_batch

    out = ctx.loss(model, slice_batch(b, 0, ctx.dp_size))  # the bug: slice 0 on every rank
    out.backward()
    return out


def one_seed_per_shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(0)  # the bug: every rank draws its shard from the same seed (a meta-device init)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    return model


def drops_a_bias(model, mesh):
    model.norm.bias = None  # the bug: a parameter that exists on no rank
    return ddp(model, mesh)


def partial_output(model, mesh):
    from torch.distributed.tensor import Partial

    return plain_tp(model, mesh, Partial())  # the bug: a wrong output layout, each rank its own partial sum


def lr_by_rank(params):
    rank = dist.get_rank() if dist.is_initialized() else 0
    return torch.optim.AdamW(params, lr=1e-3 * (1 + rank))  # the bug: replicas step apart


def lr_on_the_cluster(params):
    return torch.optim.AdamW(params, lr=1e-3 * (2 if dist.is_initialized() else 1))  # the bug: another lr there


def expect_factor(n: int, words: str):
    def expect(report):
        # the factor found is the bug's within the gradients' bound (1e-5 in fp32, bf16's roundings in bf16)
        rel = max([1e-4] + [report.bounds.grad(f.tensor) for f in report.findings if f.tensor])
        assert report.factor == pytest.approx(n, rel=rel), report.summary()
        said = f"[gradients] every tensor's first-step gradient is {report.factor:.4g} x the reference's: {words}"
        assert said in report.summary(), report.summary()

    return expect


def expect_first(check: str, tensors, message: str = ""):
    def expect(report):
        first = report.first()
        assert first is not None and first.check == check and first.tensor in tensors, report.summary()
        assert report.summary().startswith(f"verify FAILED on {_mesh(report)}: [{check}] {first.tensor}: ")
        assert message in first.message and report.factor is None

    return expect


def expect_found(*checks: str, bf16: tuple[str, ...] | None = None):
    """Each of `checks` finds something (`bf16`'s instead in a bf16 run, where they differ)."""

    def expect(report):
        want = checks if bf16 is None or report.precision == "fp32" else bf16
        assert set(want) <= {f.check for f in report.findings}, report.findings

    return expect


def _mesh(report) -> str:
    return ", ".join(f"{k}={v}" for k, v in report.mesh.items())


DP, TP = {"dp": 4}, {"dp": 2, "tp": 2}


LP = {"step": loss_parallel_step}


BUGS = {
    # name: (parallelize, mesh, options, what the report must say)
    "summed, not averaged": (summed, DP, {}, expect_factor(4, "summed where it should be averaged")),
    "accumulation not divided": (ddp, DP, {"step": accumulate(False)}, expect_factor(2, "summed where")),
    "loss reported summed": (ddp, DP, {"step": accumulate(True, loss_mean=False)}, expect_found("losses")),
    "norm outside SP": (sp_without_the_norm, TP, LP, expect_first("gradient replicas", ("norm.weight", "norm.bias"))),
    "plan key matches nothing": (
        lambda m, mesh: tp_sp(m, mesh, sp_plan("nrom")),
        TP,
        LP,
        expect_first("plan", ("nrom",), "selects no module"),
    ),
    "Partial output layout": (
        partial_output,
        {"tp": 4},
        {},
        expect_first("gradient replicas", ("down.bias", "down.weight", "norm.weight", "norm.bias", "emb.weight")),
    ),
    "same batch on every rank": (
        ddp,
        DP,
        {"step": same_batch},
        expect_first("gradients", ("head.weight", "emb.weight")),
    ),
    "one seed per shard": (one_seed_per_shard, DP, {}, expect_first("initial", ("emb.weight",), "identical")),
    "a parameter on no rank": (drops_a_bias, DP, {}, expect_first("coverage", ("norm.bias",), "exists on no rank")),
    "replicas step apart": (ddp, DP, {"optimizer": lr_by_rank}, expect_found("parameter replicas")),
    "another lr on the ranks": (
        ddp,
        DP,
        {"optimizer": lr_on_the_cluster},
        expect_found("losses", "parameters", bf16=("parameters",)),
    ),
}


def in_bf16(step=None):
    """A rank step under autocast to bf16 (the masters and the optimizer stay fp32): a user's bf16 run."""
    from labkit.engines.verify import plain_step

    def run(model, b, ctx):
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            return (step or plain_step)(model, b, ctx)

    return run


def options_in(precision: str, options: dict) -> dict:
    """A bug's verify options in `precision`: bf16 runs its step under autocast and is held to bf16's bounds."""
    if precision == "fp32":
        return options
    return {**options, "step": in_bf16(options.get("step")), "precision": precision}


def halved_after_backward(model, b, ctx):
    """The plain rank step, then every gradient halved: divided by 2 once too often."""
    out = ctx.loss(model, ctx.shard(b))
    out.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(2)
    return out
