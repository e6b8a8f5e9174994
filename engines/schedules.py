"""Step schedules for pp == 1: run every microbatch's forward and backward on one chunk.

(The pipeline schedules live with the pipeline strategy; they have the same signature.)
"""
from __future__ import annotations

import torch


def accumulate(par, microbatches: list[tuple[torch.Tensor, torch.Tensor]], meters) -> float:
    """Gradient accumulation: forward+backward of each microbatch; the loss of each is divided by
    their count, so the accumulated gradient is that of the mean loss. Returns the mean loss."""
    model = par.chunks[0]
    m = len(microbatches)
    total = torch.zeros((), device=meters.device)
    for i, (tokens, targets) in enumerate(microbatches):
        meters.check_cancelled()
        tokens, targets, positions = par.inputs(tokens, targets)
        with par.grads.microbatch(i, m):
            with meters.phase("forward"), meters.span("F", i), meters.memory.saved_tensors():
                loss = model(tokens, targets, positions)
            with meters.phase("backward"), meters.span("B", i):
                (loss / m).backward()
        total = total + loss.detach().float()
    return float(total) / m
