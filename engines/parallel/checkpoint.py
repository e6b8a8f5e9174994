"""Activation checkpointing: keep each block's input, recompute the block in backward.

Full recomputation (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016;
Korthikanti et al., MLSys 2023, section 4: "full activation recomputation"): a block's forward
runs without building a graph and saves only its input x (b, s, h); when backward reaches the
block, its forward runs again with grad on and is backpropagated at once. A block then holds
s·b·h elements until backward instead of the sbh(34 + 5as/h) bytes of the Korthikanti table
(in the lab model: 8bsh + 2bsf + ...; labkit/theory/memory.py), at the price of one more
forward per block. The model has no dropout, so the recomputation needs no saved RNG state.

`Recompute` is a reentrant autograd.Function (Megatron's CheckpointFunction, in a few lines),
chosen over torch.utils.checkpoint's non-reentrant mode because its one saved tensor and its
recomputed activations pass through the memory meter's saved-tensor hooks, so the drop is
measured, not assumed. The block's `forward` is replaced on the instance, so module hooks
(ZeRO-3's gather, FSDP2's unshard) still run around the whole checkpointed block and the
recomputation calls the original forward without firing them a second time.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn


class Recompute(torch.autograd.Function):
    """forward: y = block(x) without a graph, saving x; backward: y = block(x) again with grad, then
    backpropagate dy through it (its saved tensors are counted by `meter` while they live)."""

    @staticmethod
    def forward(ctx, run, meter, x):
        ctx.run, ctx.meter = run, meter
        ctx.save_for_backward(x)
        return run(x)                        # grad mode is off inside a Function's forward

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad(), ctx.meter.saved_tensors():
            y = ctx.run(x)                   # (b, s, h) -> (b, s, h), the block's graph rebuilt
        torch.autograd.backward(y, dy)       # parameter grads accumulate as usual (hooks fire)
        return None, None, x.grad


def _checkpointed(run, meter, x: torch.Tensor) -> torch.Tensor:
    return Recompute.apply(run, meter, x)


def apply_ac(model: nn.Module, meters) -> nn.Module:
    """Checkpoint every transformer block of `model` (slot 4 of parallelize)."""
    for block in model.blocks:
        block.forward = partial(_checkpointed, block.forward, meters.memory)   # block.forward: the bound original
    return model
