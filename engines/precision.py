"""Compute precision: fp32, or bf16 compute with fp32 master weights.

`compute_copy(module, precision)` returns what runs forward and backward. For fp32 it is the
module itself. For bf16 it is a bf16 copy whose gradients are handed to the optimizer as fp32
and whose weights are refreshed from the fp32 masters after each update — the 2 + 2 + 12 bytes
per parameter that the ZeRO paper counts (bf16 weights, bf16 grads, fp32 master + two moments).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn


class Compute:
    """The module that runs forward/backward, and how its grads reach the fp32 masters."""

    def __init__(self, master: nn.Module, module: nn.Module):
        self.master = master
        self.module = module

    def master_grads(self) -> list[torch.Tensor]:
        """fp32 gradients, in the masters' parameter order."""
        return [p.grad.float() if p.grad is not None else torch.zeros_like(m, dtype=torch.float32)
                for m, p in zip(self.master.parameters(), self.module.parameters())]

    def after_step(self) -> None:
        """Zero the compute grads; copy updated masters into the compute weights (bf16)."""
        with torch.no_grad():
            for m, p in zip(self.master.parameters(), self.module.parameters()):
                p.grad = None
                if p is not m:
                    p.copy_(m)


def compute_copy(module: nn.Module, precision: str) -> Compute:
    if precision == "fp32":
        return Compute(module, module)
    if precision == "bf16":
        low = copy.deepcopy(module).to(torch.bfloat16)
        return Compute(module, low)
    raise ValueError(f"precision={precision!r}: use 'fp32' or 'bf16'")
