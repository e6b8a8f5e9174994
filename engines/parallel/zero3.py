"""ZeRO stage 3 / FSDP units, labkit's own: parameters, gradients and optimizer state sharded, a
unit's parameters all-gathered just before it runs and freed after (Rajbhandari et al., SC 2020,
section 5.3; Zhao et al., "PyTorch FSDP", VLDB 2023, section 3). engines/parallel/zero.py has the
stages 1 and 2 and the overview; DERIVATIONS.md the derivations.

Under pipeline parallelism a stage runs m forwards and m backwards per step, interleaved with
other microbatches', so a unit is gathered at its first forward and kept until its last backward,
and its gradients accumulate, unsharded, in one buffer until the step's last backward has
delivered them, then are reduce-scattered once (`keep`): one all-gather and one reduce-scatter
per unit and step, as torchtitan composes FSDP2 with pipelining (reshard_after_forward off under
PP, gradient sync only on the last microbatch's backward).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn

from labkit.config import OptimConfig
from labkit.engines.float8 import WeightScales
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
from labkit.engines.parallel.zero3_float8 import dequantized, fp8_names, to_fp8_buffers
from labkit.engines.precision import Policy
from labkit.layout.flat import FlatLayout, unit_layouts


class _Unit:
    """One ZeRO-3 / FSDP unit: a module's flat buffer of parameters, gathered only while needed.

    `full` is the gathered buffer (padded,); the module's parameters are views of it, made once.
    Freeing it shrinks its storage to 0 bytes (storage.resize_, as PyTorch's FSDP does), which keeps
    every view, including the ones autograd saved in forward, valid for the next gather."""

    def __init__(
        self, layout: FlatLayout, modules: list[nn.Module], params: dict[str, nn.Parameter], mesh, pol: Policy
    ):
        self.layout, self.modules = layout, modules  # what runs it: one module, or its parts in several chunks
        self.group, self.n, self.index = layout_group(mesh, layout)  # the ranks that shard this buffer
        self.replicas = replica_group(mesh, layout)  # HSDP: the ranks holding the same shard, or None
        self.params = [params[n] for n in layout.names]
        self.slot = {id(params[n]): (lo, hi) for n, _, lo, hi in layout.offsets()}
        full32 = flatten(layout, params)
        a, b = layout.owned(self.index)
        self.full = full32.to(pol.compute) if pol.mixed else full32
        self.shard = self.full[a:b].clone()  # what this rank all-gathers
        self.master = full32[a:b].clone() if pol.mixed else self.shard  # what its optimizer updates
        self.grad = torch.zeros_like(self.shard)  # its reduced gradient slice
        bind(layout, params, self.full)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.grad_full: torch.Tensor | None = None
        self.pending = 0
        self.tied = False  # holds a tied embedding's copy (pipeline): reduced in finish(), after the tied sum


class ZeRO3:
    """ZeRO stage 3 / FSDP (ours; GradSync): parameters, gradients and optimizer state sharded, a
    unit's parameters gathered just before it runs. `kind` picks the units (layout/flat.py): 'zero3' the
    embedding, each block and the head; 'fsdp' each block plus the root. With reshard=False
    (FSDP's reshard_after_forward off) forward's gather is kept for backward: one all-gather per
    unit instead of two (ZeRO-2's traffic), the whole model gathered at the end of forward.

    Composed with tp / ep / cp, a unit holds this rank's slices, and a module whose parameters
    are reduced over different groups (experts over dp-cp, SP LayerNorms over dp-ep-cp-tp) has
    one unit per group, each sharded over its own group (layout/flat.py). `chunks`: this rank's
    pipeline chunks (one module without a pipeline); with several stages' microbatches in
    flight (`keep`, pp > 1) a unit stays gathered over the step and is reduced once (module
    docstring). `float8`: under fp8 (tensorwise) the fp8 linears' weights are gathered in fp8, their
    scales kept there (zero3_float8.py)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh,
        metas: ParamMetas,
        *,
        kind: str,
        reshard: bool,
        pol: Policy,
        optim: OptimConfig,
        meters,
        loss_shards: int,
        keep: bool = False,
        float8: WeightScales | None = None,
    ):
        self.modules = chunks
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        params = {metas[p].full_name(n): p for n, p in named}
        self.pol, self.reshard, self.meters, self.loss_shards, self.keep = pol, reshard, meters, loss_shards, keep
        fp8 = fp8_names(chunks, metas) if float8 is not None else frozenset()
        self.layouts = unit_layouts(entries(named, metas, mesh), group_sizes(mesh, named, metas), kind, fp8)
        self.units = [_Unit(p, _unit_modules(chunks, p.unit), params, mesh, pol) for p in self.layouts]
        self.float8 = float8
        for u in self.units:
            if u.layout.fp8:
                to_fp8_buffers(u, chunks, float8)
        self.tied_group, self.tied = tied_params(list(params.values()), metas, mesh)
        self.count = 1  # microbatches per step (microbatch())
        for u in self.units:
            u.tied = any(id(p) in self.tied for p in u.params)
            for module in u.modules:
                module.register_forward_pre_hook(partial(self._pre_forward, u))
                if not keep:
                    module.register_forward_hook(partial(self._post_forward, u))
            for p in u.params:
                p.register_post_accumulate_grad_hook(weak_method(self, "_grad_ready", u))
        self.optimizer = ShardedOptimizer(
            self.layouts,
            [u.index for u in self.units],
            [u.master for u in self.units],
            mesh,
            params,
            metas,
            optim,
            [u.group for u in self.units],
        )
        self.in_flight = None  # (unit, buffer, work): one reduce-scatter in flight

    # -- gather / free ----------------------------------------------------------------------
    def _gather(self, u: _Unit) -> None:
        if u.gathered:
            return
        if u.layout.fp8:
            self.float8.refresh()  # this step's scales and fp8 shards (an all-reduce, once per step)
        u.full.untyped_storage().resize_(u.nbytes)
        self.meters.memory.track("gathered", u.nbytes)
        if u.n > 1:  # (shard,) from every rank -> (padded,)
            all_gather_single(u.full, u.shard, group=u.group)
        else:
            u.full.copy_(u.shard)
        u.gathered = True

    def _free(self, u: _Unit) -> None:
        if u.gathered:
            u.full.untyped_storage().resize_(0)
            self.meters.memory.track("gathered", -u.nbytes)
            u.gathered = False

    # -- hooks ------------------------------------------------------------------------------
    def _pre_forward(self, u: _Unit, module, args) -> None:
        self._gather(u)  # (keep: once per step, at the unit's first forward)

    def _post_forward(self, u: _Unit, module, args, out) -> None:
        if self.reshard:
            self._free(u)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(partial(self._pre_backward, u))  # fires as backward reaches the unit

    def _pre_backward(self, u: _Unit, grad: torch.Tensor) -> None:
        """Gather the unit again (if freed) and give its gradients a buffer in the reduce dtype:
        under fp32 the parameters' .grad are views of it, under bf16 each is copied in on arrival."""
        self._gather(u)
        u.grad_full = torch.zeros(u.layout.padded, dtype=self.pol.reduce, device=u.shard.device)
        self.meters.memory.track("reduce_buffers", u.grad_full.nbytes)
        if self.pol.reduce == self.pol.compute:
            bind(u.layout, dict(zip(u.layout.names, u.params)), u.grad_full, grads=True)
        u.pending = len(u.params)

    def _grad_ready(self, u: _Unit, p: nn.Parameter) -> None:
        if self.keep and u.grad_full is None:  # the unit's first gradient of the step: its buffer
            self._keep_buffer(u, p)
        elif self.pol.reduce != self.pol.compute:
            lo, hi = u.slot[id(p)]
            u.grad_full[lo:hi].add_(p.grad.reshape(-1))  # (several microbatches' sum under keep)
            p.grad = None
        u.pending -= 1
        if u.pending == 0 and not u.tied:  # a tied copy waits for finish(): both stages' parts summed first
            self._reduce(u)

    def _keep_buffer(self, u: _Unit, p: nn.Parameter) -> None:
        """keep: the unit's gradient buffer, made when its first gradient of the step arrives and
        kept until all m microbatches' have (the last microbatch's backward); that gradient goes in,
        and under fp32 every parameter's .grad becomes a view of it, where autograd accumulates."""
        u.grad_full = torch.zeros(u.layout.padded, dtype=self.pol.reduce, device=u.shard.device)
        self.meters.memory.track("reduce_buffers", u.grad_full.nbytes)
        lo, hi = u.slot[id(p)]
        u.grad_full[lo:hi].copy_(p.grad.reshape(-1))
        p.grad = None
        if self.pol.reduce == self.pol.compute:
            bind(u.layout, dict(zip(u.layout.names, u.params)), u.grad_full, grads=True)
        u.pending = len(u.params) * self.count

    def _reduce(self, u: _Unit) -> None:
        """The unit's backward is over: free its parameters, reduce-scatter its gradient."""
        for p in u.params:
            p.grad = None
        self._free(u)
        self._drain()
        buf, u.grad_full = u.grad_full, None
        a, b = u.layout.owned(u.index)
        work = (
            reduce_scatter_single(buf[a:b], buf, group=u.group, async_op=True) if u.n > 1 else None
        )  # (padded,) summed over ranks -> its slice a:b, in place
        self.in_flight = (u, buf, work)

    def _drain(self) -> None:
        if self.in_flight is None:
            return
        u, buf, work = self.in_flight
        if work is not None:
            work.wait()
        a, b = u.layout.owned(u.index)
        all_reduce_replicas(buf[a:b], u.replicas)  # HSDP: the shard group's sum, summed over the replicas
        u.grad.add_(buf[a:b])  # fp32 sum rounded into the bf16 slice under bf16
        self.meters.memory.track("reduce_buffers", -buf.nbytes)
        self.in_flight = None

    # -- GradSync -----------------------------------------------------------------------------
    @contextmanager
    def microbatch(self, index: int, count: int):
        self.count = count
        yield
        if self.keep:
            return  # units are reduced as their last gradient arrives, or in finish()
        for u in self.units:  # a unit whose gradients did not all arrive (unused parameters)
            if u.grad_full is not None:
                self._reduce(u)

    def finish(self) -> None:
        for u in self.units:  # keep: tied copies (their two stages' parts summed first), unused parameters
            if u.grad_full is not None:
                if u.tied:
                    for p in u.params:
                        lo, hi = u.slot[id(p)]
                        if id(p) in self.tied:
                            all_reduce_tied(u.grad_full[lo:hi], self.tied_group)
                self._reduce(u)
        for u in self.units:  # keep: a unit gathered but never given a gradient
            self._free(u)
        self._drain()
        if self.loss_shards > 1:
            for u in self.units:
                u.grad.div_(self.loss_shards)

    @torch.no_grad()
    def step(self) -> float:
        norm = self.optimizer.step([u.grad for u in self.units])
        for u in self.units:
            if self.pol.mixed and not u.layout.fp8:  # (an fp8 shard is cast at the next gather)
                u.shard.copy_(u.master)  # round the updated masters into the bf16 slice
            u.grad.zero_()
        return norm

    def memory(self) -> dict[str, int]:
        masters = [u.master for u in self.units] if self.pol.mixed else []
        return {
            "params": unique_bytes(u.shard for u in self.units),
            "grads": unique_bytes(u.grad for u in self.units),
            "optimizer": unique_bytes(masters + self.optimizer.state_tensors()),
        }

    def param_pieces(self) -> list[dict]:
        return self.optimizer.param_pieces()

    def grad_pieces(self) -> list[dict]:
        return self.optimizer.param_pieces([u.grad for u in self.units])

    @torch.no_grad()
    def compute_pieces(self) -> list[dict]:
        """Each unit gathered as its next forward would gather it (a collective per unit, in layout
        order on every rank), read whole, and freed."""
        out = []
        for u in self.units:
            was = u.gathered
            self._gather(u)
            out += self.optimizer.whole_pieces(u.layout, dequantized(u) if u.layout.fp8 else u.full)
            if not was:
                self._free(u)
        return out


def _unit_modules(chunks: list[nn.Module], unit: str) -> list[nn.Module]:
    """The modules whose forward uses a unit's parameters: the unit's module in the one chunk
    that has it ('blocks.3', 'embed', 'head'), or for the root ('') every chunk that holds part of
    it (without a pipeline: the model; with one: the chunks with the embedding or the head)."""
    if unit == "":
        return [c for c in chunks if len(chunks) == 1 or c.embed is not None or c.head is not None]
    found = []
    for c in chunks:
        try:
            module = c.get_submodule(unit)
        except AttributeError:
            continue
        if module is not None:
            found.append(module)
    return found
