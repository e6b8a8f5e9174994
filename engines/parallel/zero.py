"""ZeRO: sharded data parallelism, stages 1, 2 and 3, labkit's own (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, section 5).

Every data rank sees different samples, as in DDP, but the model states are split N ways
instead of replicated. Parameters live in flat buffers (layout/flat.py: padded to a multiple of N,
rank i owns slice i), and rank i keeps the fp32 master weights and Adam moments of its slices
only, so its optimizer updates exactly those elements — element for element the update that
AdamW (engines/optim.py) makes on the full tensors.

  stage 1 (P_os)     optimizer state sharded. Full gradients accumulate in the flat buffers;
                     each bucket is reduce-scattered (rank i receives the sum of slice i) as soon
                     as backward has filled it; after the update every rank all-gathers the
                     updated slices. Wire: reduce-scatter + all-gather = 2Ψ(N-1)/N, DDP's volume.
  stage 2 (P_os+g)   gradients sharded too: a bucket's full gradient exists only from its first
                     gradient to the end of its reduce-scatter; each rank keeps its own slice.
  stage 3 (P_os+g+p) parameters sharded too (`ZeRO3`): a unit's parameters (one flat buffer
                     per block, and the embedding and the head) are all-gathered just before its
                     forward and freed after it, gathered again when backward reaches it, and
                     freed once its gradients are reduce-scattered. Wire: 3Ψ(N-1)/N.

Memory per rank (bytes per element of Ψ, mixed precision): 2+2+12 -> 2+2+12/N -> 2+14/N -> 16/N.
With microbatches, stage 1 reduces once, after the last (as DDP's no_sync); stages 2 and 3
reduce-scatter every microbatch and add into their gradient slices, since they keep no full
gradient to accumulate into. Under pipeline parallelism (`once`) they reduce once too: a stage's
backwards of different microbatches interleave with other stages' work, so stage 2 keeps each
bucket's gradient, unsharded, from its first microbatch to its last and stage 3 keeps its units
gathered (zero3.py), as torchtitan composes FSDP with pipelining. Reduce-scatters run
asynchronously, one in flight.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from labkit.config import OptimConfig
from labkit.engines.meters.memory import unique_bytes
from labkit.engines.parallel.common import (
    ParamMetas,
    all_gather_single,
    all_reduce_tied,
    reduce_scatter_single,
    tied_params,
    weak_method,
)
from labkit.engines.parallel.shards import (
    ShardedOptimizer,
    all_reduce_replicas,
    bind,
    entries,
    flatten,
    group_sizes,
    layout_group,
    replica_group,
)
from labkit.engines.parallel.zero3 import ZeRO3
from labkit.engines.precision import Policy
from labkit.layout.flat import bucket_layouts, unit_kind


class ZeRO12:
    """ZeRO stages 1 and 2 (GradSync, engines/parallel/common.py) over DDP's buckets.

    A bucket is reduce-scattered from a buffer in the reduce dtype (precision.py): under fp32,
    stage 1's persistent full gradient itself; under bf16, an fp32 copy made for the collective;
    in stage 2, the bucket's transient buffer, which each gradient is copied into as it arrives.
    The reduced slice lands in this rank's gradient shard (compute dtype).

    Composed with tp / pp / ep / cp, each bucket holds parameters of one reduce group and one
    pipeline chunk (layout/flat.py) and is sharded over that group; stage 1 reduces a chunk's buckets
    as soon as its last backward is over, as DDP does. Stage 1 under bf16 with several
    microbatches sums their gradients in the bucket's fp32 buffer as they arrive, as DDP does
    (ddp.py says why). `once` (pipeline parallelism): stage 2 adds every microbatch's gradients into
    the bucket's buffer and reduce-scatters it once, after the chunk's last backward."""

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh,
        metas: ParamMetas,
        stage: int,
        pol: Policy,
        bucket_bytes: int,
        optim: OptimConfig,
        meters,
        loss_shards: int,
        once: bool = False,
    ):
        self.modules = chunks
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        params = {metas[p].full_name(n): p for n, p in named}
        self.params = params
        self.stage, self.pol, self.meters, self.loss_shards = stage, pol, meters, loss_shards
        self.once = stage == 1 or once  # reduce once per step, after the last microbatch
        elem = torch.tensor([], dtype=pol.compute).element_size()
        self.layouts = bucket_layouts(entries(named, metas, mesh), group_sizes(mesh, named, metas), bucket_bytes, elem)
        self.groups = [layout_group(mesh, layout) for layout in self.layouts]  # (group, N, shard index) per bucket
        self.replicas = [replica_group(mesh, layout) for layout in self.layouts]  # HSDP: across the replicas
        self.flats, masters, self.grads, self.grad_full = [], [], [], []
        for k, layout in enumerate(self.layouts):
            full32 = flatten(layout, params)
            a, b = layout.owned(self.groups[k][2])
            flat = full32.to(pol.compute) if pol.mixed else full32
            masters.append(full32[a:b].clone() if pol.mixed else flat[a:b])
            bind(layout, params, flat)
            self.flats.append(flat)
            if stage == 1:  # full gradients; the parameters' .grad are views of them, as in DDP
                full = torch.zeros_like(flat)
                bind(layout, params, full, grads=True)
                self.grad_full.append(full)
                self.grads.append(full[a:b])
            else:
                self.grads.append(torch.zeros(layout.shard, dtype=pol.compute, device=flat.device))
        self.bucket_of = {
            id(params[name]): (k, lo, hi) for k, p in enumerate(self.layouts) for name, _, lo, hi in p.offsets()
        }
        self.tied_group, self.tied = tied_params(list(params.values()), metas, mesh)  # stage 1 with pp only
        self.optimizer = ShardedOptimizer(
            self.layouts, [g[2] for g in self.groups], masters, mesh, params, metas, optim, [g[0] for g in self.groups]
        )
        self.pending = [0] * len(self.layouts)
        self.filling: dict[int, torch.Tensor] = {}  # stage 2: bucket -> its buffer, until launched
        self.acc: dict[int, torch.Tensor] = {}  # stage 1, bf16, microbatches: bucket -> fp32 sum
        self.accumulate = False
        self.in_flight = None  # (bucket, buffer, work): one reduce-scatter at a time
        self.next_launch = 0
        self.sync = True
        for p in params.values():  # held weakly: see common.weak_method
            p.register_post_accumulate_grad_hook(weak_method(self, "_grad_ready"))

    @contextmanager
    def microbatch(self, index: int, count: int):
        self.sync = not self.once or index == count - 1
        self.accumulate = self.stage == 1 and count > 1 and self.pol.reduce != self.pol.compute
        self.pending = [len(p.names) for p in self.layouts]
        yield
        if not self.once:  # buckets whose gradients did not all arrive (unused parameters) go too, in order
            self._launch_ready(all_remaining=True)
            self.next_launch = 0

    def _grad_ready(self, p: nn.Parameter) -> None:
        k, lo, hi = self.bucket_of[id(p)]
        if self.accumulate:  # bf16 microbatches: into the bucket's fp32 sum, the bf16 view back to 0
            if k not in self.acc:
                self.acc[k] = self._track(
                    torch.zeros(self.layouts[k].padded, dtype=self.pol.reduce, device=self.flats[k].device)
                )
            self.acc[k][lo:hi].add_(p.grad.reshape(-1))
            p.grad.zero_()
        if self.stage == 2:  # into the bucket's buffer (summed over microbatches when `once`); p.grad dropped
            if k not in self.filling:
                self.filling[k] = self._track(
                    torch.zeros(self.layouts[k].padded, dtype=self.pol.reduce, device=self.flats[k].device)
                )
            self.filling[k][lo:hi].add_(p.grad.reshape(-1))
            p.grad = None
        if not self.sync or id(p) in self.tied:  # a tied embedding's copy waits for finish()
            return
        self.pending[k] -= 1
        self._launch_ready()

    def _track(self, buf: torch.Tensor, sign: int = 1) -> torch.Tensor:
        """Count a transient reduce buffer in (sign 1) or out (-1) of the memory meter."""
        self.meters.memory.track("reduce_buffers", sign * buf.nbytes)
        return buf

    def _launch_ready(self, all_remaining: bool = False) -> None:
        """Reduce-scatter buckets in layout order as far as they are complete (or all, at the end)."""
        while self.next_launch < len(self.layouts):
            k = self.next_launch
            if self.pending[k] > 0 and not all_remaining:
                return
            if self.stage == 2:
                buf = self.filling.pop(k, None)
                if buf is None:  # no gradient of this bucket arrived
                    buf = self._track(
                        torch.zeros(self.layouts[k].padded, dtype=self.pol.reduce, device=self.flats[k].device)
                    )
            elif k in self.acc:
                buf = self.acc.pop(k)
            elif self.pol.reduce != self.pol.compute:
                buf = self._track(self.grad_full[k].to(self.pol.reduce))
            else:
                buf = self.grad_full[k]
            self._drain()
            group, n, index = self.groups[k]
            a, b = self.layouts[k].owned(index)
            work = (
                reduce_scatter_single(buf[a:b], buf, group=group, async_op=True) if n > 1 else None
            )  # (padded,) summed over ranks -> its slice a:b, in place
            self.in_flight = (k, buf, work)
            self.next_launch += 1

    def _drain(self) -> None:
        """Finish the reduce-scatter in flight: its slice into the gradient shard, its buffer freed."""
        if self.in_flight is None:
            return
        k, buf, work = self.in_flight
        self.in_flight = None
        if work is not None:
            work.wait()
        a, b = self.layouts[k].owned(self.groups[k][2])
        all_reduce_replicas(buf[a:b], self.replicas[k])  # HSDP: the shard group's sum, over the replicas
        if self.stage == 1 and buf is self.grad_full[k]:
            return  # reduced in place
        if self.stage == 1:
            self.grads[k].copy_(buf[a:b])  # fp32 sum rounded once into the bf16 slice
        else:
            self.grads[k].add_(buf[a:b])  # accumulates over microbatches
        self._track(buf, -1)

    def finish(self) -> None:
        for k, fl in enumerate(self.layouts):  # a tied embedding: both stages' parts summed before the reduce-scatter
            for name, _, lo, hi in fl.offsets():
                if id(self.params[name]) in self.tied:
                    full = self.filling[k] if self.stage == 2 else self.acc[k] if k in self.acc else self.grad_full[k]
                    all_reduce_tied(full[lo:hi], self.tied_group)
        if self.once:  # buckets whose gradients did not all arrive (unused parameters) go too, in order
            self._launch_ready(all_remaining=True)
            self.next_launch = 0
        self._drain()
        if self.loss_shards > 1:
            for g in self.grads:
                g.div_(self.loss_shards)

    @torch.no_grad()
    def step(self) -> float:
        norm = self.optimizer.step(self.grads)
        for layout, (group, n, index), flat, m in zip(self.layouts, self.groups, self.flats, self.optimizer.masters):
            a, b = layout.owned(index)
            if self.pol.mixed:
                flat[a:b].copy_(m)  # round the updated masters into this rank's bf16 slice
            if n > 1:  # (shard,) from every rank -> (padded,), in place
                all_gather_single(flat, flat[a:b], group=group)
        for g in self.grad_full or self.grads:
            g.zero_()
        return norm

    def memory(self) -> dict[str, int]:
        masters = self.optimizer.masters if self.pol.mixed else []
        return {
            "params": unique_bytes(self.flats),
            "grads": unique_bytes(self.grad_full or self.grads),
            "optimizer": unique_bytes(masters + self.optimizer.state_tensors()),
        }

    def param_pieces(self) -> list[dict]:
        return self.optimizer.param_pieces()

    def grad_pieces(self) -> list[dict]:
        return self.optimizer.param_pieces(self.grads)

    def compute_pieces(self) -> list[dict]:
        """The whole buffers forward reads, as the step's all-gather left them on this rank."""
        return [
            pc for layout, flat in zip(self.layouts, self.flats) for pc in self.optimizer.whole_pieces(layout, flat)
        ]


def apply_zero(
    chunks: list[nn.Module],
    mesh,
    metas: ParamMetas,
    *,
    stage: int,
    bucket_bytes: int,
    pol: Policy,
    optim: OptimConfig,
    meters,
    loss_shards: int,
    float8=None,
):
    """ZeRO stage 1, 2 or 3 (impl='lab'): this rank's GradSync over every pipeline chunk's parameters;
    with a pipeline (pp > 1) stages 2 and 3 reduce once per step (module docstring). ZeRO-3
    shards by module units and has no buckets."""
    pipeline = mesh.size("pp") > 1
    if stage == 3:
        kind = unit_kind(per_module=True, tied=chunks[0].cfg.tied)
        return ZeRO3(
            chunks,
            mesh,
            metas,
            kind=kind,
            reshard=True,  # ZeRO-3 frees each gathered block after its use, forward and backward
            pol=pol,
            optim=optim,
            meters=meters,
            loss_shards=loss_shards,
            keep=pipeline,
            float8=float8,
        )
    return ZeRO12(chunks, mesh, metas, stage, pol, bucket_bytes, optim, meters, loss_shards, once=pipeline)
