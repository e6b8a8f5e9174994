"""lab.verify on a plain module: correct plans pass (DDP, FSDP2, TP with SP, the user's own
collectives), and the bugs of issue 31 are each caught, the report's first line naming the check
and the tensor (or the uniform factor). On the session's 4-engine cluster, 2 steps each."""

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
    logits = model(b[:, :-1])
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


def test_ddp_on_a_plain_module_is_right(lab):
    report = lab.verify(build, ddp, {"dp": 4}, batch, loss)
    report.assert_ok()
    assert report.summary().startswith("verify OK on dp=4")
    assert len(report.df) == 8 and set(report.df["status"]) == {"ok"}
    assert (report.df["initial error"] == 0).all() and (report.df["gradient error"] < 1e-5).all()


def test_fsdp2_and_own_collectives_are_right(lab):
    lab.verify(build, fsdp2, {"dp": 4}, batch, loss).assert_ok()
    lab.verify(build, own_allreduce, {"dp": 4}, batch, loss).assert_ok()


def test_summed_not_averaged_gives_the_factor(lab):
    def summed(model, mesh):
        group = mesh.get_group("dp")
        for p in model.parameters():
            p.register_hook(lambda g: (dist.all_reduce(g := g.clone(), group=group), g)[1])
        return model

    report = lab.verify(build, summed, {"dp": 4}, batch, loss)
    assert not report.ok and report.factor == pytest.approx(4, rel=1e-4)
    assert "[gradients] every tensor's first-step gradient is 4 x the reference's: summed" in report.summary()
