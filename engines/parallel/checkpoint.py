"""Activation checkpointing: keep each block's input, recompute the block in backward.

Full recomputation (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016;
Korthikanti et al., MLSys 2023, section 4: "full activation recomputation"): a block's forward
runs without building a graph and saves only its input x (b, s, h); when backward reaches the
block, its forward runs again with grad on and is backpropagated at once. A block then holds
s·b·h elements until backward instead of the sbh(34 + 5as/h) bytes of the Korthikanti table
(in the lab model: 8bsh + 2bsf + ...; labkit/theory/exact/memory.py), at the price of one more
forward per block — and of its forward collectives again (TP's, the ring's, the all-to-alls).
The model has no dropout, so the recomputation needs no saved RNG state.

`Recompute` is a reentrant autograd.Function (Megatron's CheckpointFunction, in a few lines),
chosen over torch.utils.checkpoint's non-reentrant mode because its one saved tensor and its
recomputed activations pass through the memory meter's saved-tensor hooks, so the drop is
measured, not assumed. The block's `forward` is replaced on the instance, so module hooks
(ZeRO-3's gather, FSDP2's unshard) still run around the whole checkpointed block and the
recomputation calls the original forward without firing them a second time.

A block with an MoE layer has a second output: the router's load-balancing loss, which the
layer records on itself (engines/moe.py) and engines/model.py `aux_loss` collects after the
forward. Computed inside a graph-less forward it would carry no gradient, so the function
returns it as an output of its own (its gradient recomputes the block like the block's) and
puts it back on the layer for `aux_loss` to collect.

Selective recomputation (Korthikanti et al., section 4.2): only the attention core (`attn.core`:
the softmax(QKᵀ)V kernel, or ring attention under CP) is recomputed, `RecomputeCore`; it keeps
q, k and v (which the plain kernel keeps too) and drops what the kernel saves beyond them, the
log-sum-exp. The paper's saving is the 5as/h·sbh of stored scores and masks; a flash-style kernel
never stores those, so here the saving is small, and the theory says exactly how small.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn as nn


class Recompute(torch.autograd.Function):
    """forward: (y, aux) = run(x) without a graph, saving x; backward: run(x) again with grad,
    then backpropagate (dy, daux) through it (its saved tensors are counted by `meter`)."""

    @staticmethod
    def forward(ctx, run, meter, x, block=None):
        ctx.run, ctx.meter, ctx.block = run, meter, block
        ctx.save_for_backward(x)
        return run(x)  # grad mode is off inside a Function's forward

    @staticmethod
    def backward(ctx, dy, daux):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), ctx.meter.saved_tensors(), _not_counting(ctx.block):
            y, aux = ctx.run(x)  # (b, s, h) -> (b, s, h), the block's graph rebuilt
        outs, grads = ([y, aux], [dy, daux]) if aux.requires_grad else ([y], [dy])
        torch.autograd.backward(outs, grads)  # parameter grads accumulate as usual (hooks fire)
        return None, None, x.grad, None


class RecomputeCore(torch.autograd.Function):
    """forward: y = core(q, k, v) without a graph, saving q, k, v; backward: core(q, k, v) again
    with grad, then backpropagate dy through it (Korthikanti et al.'s selective recomputation)."""

    @staticmethod
    def forward(ctx, core, meter, q, k, v):
        ctx.core, ctx.meter = core, meter
        ctx.save_for_backward(q, k, v)
        return core(q, k, v)  # (b, nh, s, hd), grad mode off inside a Function's forward

    @staticmethod
    def backward(ctx, dy):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad(), ctx.meter.saved_tensors():
            y = ctx.core(q, k, v)
        torch.autograd.backward(y, dy)
        return None, None, q.grad, k.grad, v.grad


@contextmanager
def _not_counting(block):
    """The rerun routes the same tokens again: its MoE layers add nothing to their expert loads
    (engines/moe.py `loads`, the aux-loss-free bias's input), so the bias sees each token once."""
    moes = [m for m in block.modules() if hasattr(m, "counting")] if block is not None else []
    for m in moes:
        m.counting = False
    try:
        yield
    finally:
        for m in moes:
            m.counting = True


def _with_aux(block: nn.Module, forward, x: torch.Tensor, rope=None):
    """The block's output and the sum of its MoE layers' balance losses (0 without any), taken
    off the layers so that only the returned one is collected. `rope`: the rotary tables (llama),
    constants of the forward that the recomputation reuses."""
    y = forward(x, rope)
    moes = [m for m in block.modules() if getattr(m, "aux_loss", None) is not None]
    aux = sum(m.aux_loss for m in moes) if moes else torch.zeros((), device=x.device)
    for m in moes:
        m.aux_loss = None
    return y, aux


def _checkpointed(block: nn.Module, run, meter, x: torch.Tensor, rope=None) -> torch.Tensor:
    y, aux = Recompute.apply(partial(run, rope=rope), meter, x, block)
    if hasattr(block.mlp, "aux_loss"):  # an MoE block: its loss, now with a gradient path
        block.mlp.aux_loss = aux
    return y


def apply_ac(model: nn.Module, memory_meter, selective: bool = False) -> tuple[nn.Module, dict]:
    """Checkpoint every transformer block of `model` (slot 4 of parallelize), or with `selective`
    only its attention core; the recomputation's saved tensors are counted by `memory_meter`.
    Returns (model, {}): nothing to report."""
    for block in model.blocks:
        if selective:
            block.attn.core = partial(RecomputeCore.apply, block.attn.core, memory_meter)
            continue
        run = partial(_with_aux, block, block.forward)  # block.forward: the bound original
        block.forward = partial(_checkpointed, block, run, memory_meter)
    return model, {}
