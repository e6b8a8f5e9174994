"""Compute precision: fp32, or bf16 compute with fp32 master weights (mixed precision).

Mixed precision as the ZeRO paper counts it (Rajbhandari et al., SC 2020, section 3.1, after
Micikevicius et al., ICLR 2018): forward and backward run on bf16 parameters and produce bf16
gradients (2 + 2 bytes per parameter); the optimizer keeps fp32 master weights and fp32 Adam
moments (K = 12 bytes) and after each update the masters are rounded into the bf16 weights.
The loss is taken in fp32 (the model's Head casts the logits).

The reduce dtype is a choice; labkit reduces gradients in fp32 (as torchtitan's FSDP2 default
does) and keeps them in bf16 otherwise, so the states stay 2 + 2 + 12 bytes per parameter. Each
bucket (DDP, ZeRO-1/2) or unit (ZeRO-3/FSDP) is copied into an fp32 buffer just for its
collective and the result rounded back into the bf16 gradients once. Why not sum in bf16, at
half the wire bytes: a bf16 sum rounds every partial sum to 8 bits, and where the ranks'
gradients nearly cancel the sign of the result becomes rounding noise, which AdamW turns into
a full step of lr the other way (its update is ~ sign(g) early on). Measured on the tiny test
model: DDP with a bf16 all-reduce moved a LayerNorm bias 11% (relative L2) away from the
reference that splits the batch the same way; in fp32 the sum of a few bf16 values is exact,
so every rank gets the reference's gradient up to one final rounding. Parameters are still
all-gathered in bf16 (a copy, no arithmetic): the ZeRO paper's volumes (2Ψ, 3Ψ elements) hold,
with 4 bytes per reduced gradient element and 2 per gathered parameter element.

fp8 (torchao's float8 training, engines/float8.py) is bf16 mixed precision whose blocks' linear
layers compute in fp8: every tensor a strategy holds, reduces or passes between stages is bf16 as
above (the fp8 operands exist inside the matmuls; FSDP's fp8 all-gather and SP's are the two
collectives that carry them), so its policy is bf16's.

`Policy` is what the strategies read (slot 6 of parallelize); `compute_copy` is the reference's
way to the same arithmetic with no strategy involved: a bf16 copy of the model (its linear layers
torchao's Float8Linear under fp8) whose gradients are handed to the optimizer as fp32 and whose
weights are refreshed from the fp32 masters.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from labkit.config.choices import numerics
from labkit.engines.float8 import convert_torchao

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
"""The compute dtype of each precision: fp8's tensors outside its matmuls are bf16."""


@dataclass(frozen=True)
class Policy:
    """Dtypes of one precision setting."""

    compute: torch.dtype
    """Parameters, gradients and activations in forward and backward."""
    reduce: torch.dtype
    """Gradient collectives (all-reduce, reduce-scatter); parameters are all-gathered in `compute`."""
    master: torch.dtype = torch.float32
    """The weights the optimizer updates, and its moments."""

    @property
    def mixed(self) -> bool:
        """Whether the masters are a separate copy (bf16) or the compute weights themselves (fp32)."""
        return self.compute != self.master


def policy(precision: str) -> Policy:
    if precision not in DTYPES:
        raise ValueError(f"precision={precision!r}: use 'fp32', 'bf16' or 'fp8'")
    return Policy(compute=DTYPES[precision], reduce=torch.float32)


def split_masters(params: list[nn.Parameter], pol: Policy) -> list[torch.Tensor]:
    """fp32 master copies of `params`, which are then cast to the compute dtype in place; under
    fp32 the parameters are their own masters. Call it on the freshly initialised fp32 model."""
    if not pol.mixed:
        return list(params)
    masters = [p.detach().to(pol.master, copy=True) for p in params]
    for p in params:
        p.data = p.data.to(pol.compute)
    return masters


@torch.no_grad()
def copy_masters(params: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """Round the updated masters into the compute weights (nothing to do when they are the same)."""
    for p, m in zip(params, masters):
        if p is not m:
            p.copy_(m)


class Compute:
    """The module that runs forward/backward, and how its grads reach the fp32 masters."""

    def __init__(self, master: nn.Module, module: nn.Module):
        self.master = master
        self.module = module

    def master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients, in the masters' parameter order."""
        return [
            p.grad.float() if p.grad is not None else torch.zeros_like(m, dtype=torch.float32)
            for m, p in zip(self.master.parameters(), self.module.parameters())
        ]

    def zero_grads(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def after_step(self) -> None:
        """Zero the compute grads; copy updated masters into the compute weights (bf16)."""
        with torch.no_grad():
            for m, p in zip(self.master.parameters(), self.module.parameters()):
                p.grad = None
                if p is not m:
                    p.copy_(m)


def compute_copy(module: nn.Module, precision: str, fp8_recipe: str = "tensorwise") -> Compute:
    """The reference's mixed precision: `module` keeps the fp32 masters, a bf16 deep copy computes;
    under fp8 that copy's linear layers are torchao's Float8Linear, converted as torchtitan converts
    them (engines/float8.py `convert_torchao`), none of labkit's float8 code involved."""
    kind = numerics(precision)
    if not kind.mixed:
        return Compute(module, module)
    work = copy.deepcopy(module).to(torch.bfloat16)
    if kind.fp8:
        convert_torchao(work, fp8_recipe)
    return Compute(module, work)
