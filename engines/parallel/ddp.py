"""Data parallelism (DDP), two ways: labkit's own, readable, and PyTorch's DistributedDataParallel.

Every replica holds the whole model and sees different samples; after backward the gradients
are averaged over the replicas, so every replica takes the same optimizer step. Ours follows
PyTorch DDP's design (Li et al., VLDB 2020): gradients live in flat buckets, each bucket is
all-reduced asynchronously as soon as backward has produced its last gradient, so
communication overlaps the rest of backward; buckets are launched strictly in order, so every
replica issues the same sequence of collectives. With microbatches > 1 (and pp == 1) the
gradients accumulate locally and are reduced once, after the last microbatch (`no_sync`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.config import OptimConfig
from labkit.engines.meters.memory import unique_bytes
from labkit.engines.muon import Optimizer, wholes_of
from labkit.engines.optim import OPTIMIZER_STATES, clip_coefficient, decays, grad_norm, torch_adamw
from labkit.engines.parallel.common import (
    ParamMetas,
    all_reduce_tied,
    norm_terms,
    param_piece,
    tied_params,
    weak_method,
)
from labkit.engines.precision import Policy, copy_masters, policy, split_masters
from labkit.layout.buckets import grouped_buckets
from labkit.layout.optimizer import takes_muon


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group):
        self.params = params
        self.group = group
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        offset = 0
        self.slots = {}
        for p in params:  # each grad is a view into the flat buffer: no copy before the all-reduce
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            self.slots[id(p)] = (offset, offset + p.numel())
            offset += p.numel()
        self.pending = len(params)
        self.work = None
        self.reduced = None  # what the all-reduce runs on: the buffer, or its fp32 copy under bf16
        self.acc = None  # bf16 with microbatches: the fp32 sum of their gradients


def bucket_indices(params: list[nn.Parameter], metas: ParamMetas, bucket_bytes: int) -> list[list[int]]:
    """Buckets (parameter indices) in launch order: parameters are grouped by the dims their
    gradient is reduced over (ParamMeta.reduce) and by pipeline chunk (ParamMeta.chunk: a chunk's
    buckets can go as soon as its last backward is over), each group bucketed in reverse order
    (layout/buckets.py), and the buckets of all groups launched by their last parameter, latest
    first — the order backward produces them. The same on every rank that holds the same
    parameters."""
    sizes = [p.numel() * p.element_size() for p in params]
    keys = [(metas[p].reduce, metas[p].chunk) for p in params]
    return [b for _, b in grouped_buckets(sizes, keys, bucket_bytes)]


class DDP:
    """labkit's DDP; implements GradSync (engines/parallel/common.py).

    Each parameter's gradient is summed over the mesh dims its record names (ParamMeta.reduce, default
    dp x ep x cp) and divided by `loss_shards`, the number of ranks whose local mean losses
    average to the global loss (dp * ep * cp). `norm_terms` (common.py) says how the global
    gradient norm is assembled when tp / pp / ep split the parameters. Under bf16 (precision.py)
    the parameters and the bucketed gradients are bf16, each bucket is all-reduced in an fp32 copy
    (the reduce dtype) and rounded back; the optimizer updates fp32 masters and rounds them into
    the parameters. With several microbatches under bf16 the bucket's microbatch gradients are
    summed in that fp32 buffer as each arrives (the bf16 view is zeroed for the next), so
    accumulation rounds nothing either: a reduction over microbatches is a reduction, and
    precision.py says why those are fp32 (Megatron-LM accumulates into fp32 main_grad likewise).
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh,
        metas: ParamMetas,
        loss_shards: int,
        bucket_bytes: int,
        optim: OptimConfig,
        pol: Policy | None = None,
        meters=None,
    ):
        named_params = [(n, p) for c in chunks for n, p in c.named_parameters()]
        self.modules = chunks
        pol = pol or policy("fp32")
        self.reduce, self.meters = pol.reduce, meters
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.metas = metas
        self.masters = split_masters(self.params, pol)
        self.loss_shards = loss_shards
        self.optim_cfg = optim
        self.norm_group, self.counted = norm_terms([metas[p] for p in self.params], mesh)
        self.buckets = [
            _Bucket([self.params[i] for i in idx], mesh.group(*metas[self.params[idx[0]]].reduce))
            for idx in bucket_indices(self.params, metas, bucket_bytes)
        ]
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.tied_group, self.tied = tied_params(self.params, metas, mesh)
        self.next_launch = 0
        self.sync = True
        self.accumulate = False
        for p in self.params:  # held weakly: see common.weak_method
            p.register_post_accumulate_grad_hook(weak_method(self, "_grad_ready"))
        full = [(metas[p].full_name(n), metas[p].full_shape or tuple(p.shape)) for n, p in named_params]
        muon = [optim.kind.muon and takes_muon(n, s) for n, s in full]
        wholes = wholes_of(self.params, metas, mesh, muon) if any(muon) else None
        self.opt = Optimizer(self.masters, [decays(n, p) for n, p in named_params], optim, full, wholes)

    @contextmanager
    def microbatch(self, index: int, count: int):
        self.sync = index == count - 1
        self.accumulate = count > 1 and self.reduce != self.params[0].dtype
        for b in self.buckets:
            b.pending = len(b.params)
        yield

    def _grad_ready(self, p: nn.Parameter) -> None:
        bucket = self.bucket_of[id(p)]
        if self.accumulate:  # bf16 microbatches: into the bucket's fp32 sum, the bf16 view back to 0
            if bucket.acc is None:
                bucket.acc = self._track(
                    torch.zeros(bucket.buffer.numel(), dtype=self.reduce, device=bucket.buffer.device)
                )
            lo, hi = bucket.slots[id(p)]
            bucket.acc[lo:hi].add_(p.grad.reshape(-1))
            p.grad.zero_()
        if not self.sync or id(p) in self.tied:  # a tied embedding's copy waits for finish()
            return
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, all_remaining: bool = False) -> None:
        """All-reduce buckets in index order, as far as they are complete (or all, at the end)."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if b.pending > 0 and not all_remaining:
                return
            if b.acc is not None:
                b.reduced, b.acc = b.acc, None
            elif dist.get_world_size(b.group) > 1 and b.buffer.dtype != self.reduce:
                b.reduced = self._track(b.buffer.to(self.reduce))
            if dist.get_world_size(b.group) > 1:
                b.work = dist.all_reduce(
                    b.buffer if b.reduced is None else b.reduced, group=b.group, async_op=True
                )  # (numel,) summed
            self.next_launch += 1

    def _track(self, buf: torch.Tensor, sign: int = 1) -> torch.Tensor:
        """bf16: the fp32 copy a bucket is all-reduced in (precision.py), a transient."""
        if self.meters is not None:
            self.meters.memory.track("reduce_buffers", sign * buf.nbytes)
        return buf

    def finish(self) -> None:
        for p in self.params:  # a tied embedding: both stages' parts summed first, then reduced over dp
            if id(p) in self.tied:
                b = self.bucket_of[id(p)]
                lo, hi = b.slots[id(p)]
                all_reduce_tied(p.grad if b.acc is None else b.acc[lo:hi], self.tied_group)
        self._launch_ready(all_remaining=True)  # buckets with unused params still go, in order
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            out = b.buffer if b.reduced is None else b.reduced
            if self.loss_shards > 1:
                out.div_(self.loss_shards)
            if out is not b.buffer:  # the fp32 mean, rounded once into the bf16 gradients
                b.buffer.copy_(out)
                self._track(out, -1)
            b.reduced = None
        self.next_launch = 0

    def step(self) -> float:
        grads = [p.grad for p in self.params]
        norm = grad_norm(grads, self.counted, self.norm_group)
        self.opt.step(grads, clip_coefficient(norm, self.optim_cfg.clip))
        copy_masters(self.params, self.masters)
        for b in self.buckets:
            b.buffer.zero_()
        return float(norm)

    def memory(self) -> dict[str, int]:
        return {
            "params": unique_bytes(self.params),
            "grads": unique_bytes(b.buffer for b in self.buckets),
            "optimizer": unique_bytes(
                self.opt.state_tensors() + [m for m, p in zip(self.masters, self.params) if m is not p]
            ),
        }

    def param_pieces(self) -> list[dict]:
        return [param_piece(n, p, self.metas[p], values=m) for n, p, m in zip(self.names, self.params, self.masters)]

    def grad_pieces(self) -> list[dict]:
        return [param_piece(n, p, self.metas[p], values=p.grad) for n, p in zip(self.names, self.params)]

    def compute_pieces(self) -> list[dict] | None:
        """bf16: the parameters forward reads, the masters rounded; fp32: they are the masters."""
        if all(m is p for m, p in zip(self.masters, self.params)):
            return None
        return [param_piece(n, p, self.metas[p]) for n, p in zip(self.names, self.params)]


class TorchUpdate:
    """torch.optim.AdamW over the plain (not DTensor) parameters of one of PyTorch's strategies, as
    a user would write it, and what GradSync reports of them: the part TorchDDP and
    TorchStageGrads share. Each of them says how its gradients are reduced and its norm taken."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], metas: ParamMetas, optim: OptimConfig):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.metas = metas
        self.clip = optim.clip
        self.opt = torch_adamw(self.names, self.params, optim, muon=lambda n, p: takes_muon(n, tuple(p.shape)))

    def step(self) -> None:
        """Update, then zero the gradients in place (views of DDP's buckets: gradient_as_bucket_view)."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)

    def memory(self) -> dict[str, int]:
        state = [t for s in self.opt.state.values() for k, t in s.items() if k in OPTIMIZER_STATES]
        return {
            "params": unique_bytes(self.params),
            "grads": unique_bytes(p.grad for p in self.params),
            "optimizer": unique_bytes(state),
        }

    def param_pieces(self) -> list[dict]:
        return [param_piece(n, p, self.metas[p]) for n, p in zip(self.names, self.params)]

    def grad_pieces(self) -> list[dict]:
        return [param_piece(n, p, self.metas[p], values=p.grad) for n, p in zip(self.names, self.params)]


class TorchDDP:
    """PyTorch's DistributedDataParallel with torch.optim.AdamW and clip_grad_norm_, as a user
    would write it. gradient_as_bucket_view keeps one copy of the gradients (the grads are views
    of the reducer's buckets), so its memory is comparable with ours. The comm meter sees the C++
    reducer's all-reduces at the dispatcher (engines/meters/comm.py)."""

    def __init__(self, module: nn.Module, group, metas: ParamMetas, bucket_mb: float, optim: OptimConfig):
        named = list(module.named_parameters())
        self.ddp = DistributedDataParallel(
            module, process_group=group, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, broadcast_buffers=False
        )
        self.modules = [self.ddp]
        self.update = TorchUpdate(named, metas, optim)

    def microbatch(self, index: int, count: int):
        return nullcontext() if index == count - 1 else self.ddp.no_sync()

    def finish(self) -> None:
        pass  # DDP's reducer waits for its all-reduces at the end of backward

    def step(self) -> float:
        clip = self.update.clip
        norm = torch.nn.utils.clip_grad_norm_(self.update.params, clip if clip else float("inf"))
        self.update.step()
        return float(norm)

    def memory(self) -> dict[str, int]:
        return self.update.memory()

    def param_pieces(self) -> list[dict]:
        return self.update.param_pieces()

    def grad_pieces(self) -> list[dict]:
        return self.update.grad_pieces()

    def compute_pieces(self) -> None:
        return None  # fp32 only (labkit.config): forward reads the masters
