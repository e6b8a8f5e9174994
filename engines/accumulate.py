"""Gradient accumulation: the step schedule when there is no pipeline (pp == 1).

It runs every microbatch's forward and backward on the one chunk. The pipeline's schedules
(engines/parallel/pipeline/'s executor, torch.distributed.pipelining's) are called the same way:
schedule(rank_model, microbatches, meters) -> this rank's share of the loss.
"""

from __future__ import annotations

import torch


def accumulate(rank_model, microbatches: list[tuple[torch.Tensor, torch.Tensor]], meters) -> float:
    """Forward+backward of each microbatch on `rank_model` (parallelize.RankModel); the loss of each
    is divided by their count, so the accumulated gradient is that of the mean loss. Returns the
    mean loss."""
    model = rank_model.chunks[0]
    m = len(microbatches)
    total = torch.zeros((), device=meters.device)
    for i, (tokens, targets) in enumerate(microbatches):
        meters.check_cancelled()
        tokens, targets, positions = rank_model.inputs(tokens, targets)
        with rank_model.grads.microbatch(i, m):
            with meters.phase("forward"), meters.span("F", i), meters.memory.saved_tensors():
                loss = model(tokens, targets, positions)
            with meters.phase("backward"), meters.span("B", i):
                (loss / m).backward()
        total = total + loss.detach().float()
    meters.wait_device()
    return float(total) / m
