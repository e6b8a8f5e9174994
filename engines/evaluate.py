"""The validation loss: the trained model's mean LM loss on the held-out windows of the corpus.

Computed on the engines after the last step, forward only, in whatever layout the run used: each
rank runs its share exactly as it ran a training step's forward (its data shard, its
microbatches, its zigzag half under cp, its stages under pp, its slices under tp, its gathers
under ZeRO-3 / FSDP), so the shares add up the way the training losses do
(RunResult.from_reports) and equal the reference's `validation_loss`, which runs the same
windows in one process. Outside the meters: no step's bytes or timeline include it.

The loss is the LM cross-entropy alone (model.Head's output): the MoE load-balancing term the
model adds to it in training is not part of a validation loss.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.config import ModelConfig, ParallelConfig
from labkit.engines import data, runtime
from labkit.engines.model import aux_loss
from labkit.engines.p2p import Link
from labkit.engines.precision import policy
from labkit.layout import text
from labkit.layout.schedules import rank_chunk_of, stage_of, style


def _unwrap(module: nn.Module) -> nn.Module:
    """PyTorch's DDP (impl='torch') only adds backward hooks: a forward without gradients needs the
    module it wraps, whose `head` is the model's."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def lm_loss(module: nn.Module, *args) -> torch.Tensor:
    """Run `module` (a whole model, or the last pipeline chunk) and return what its head computed:
    the mean cross-entropy, without any MoE balance term that the model's forward adds to it."""
    seen = []
    handle = _unwrap(module).head.register_forward_hook(lambda mod, inputs, out: seen.append(out))
    try:
        module(*args)
    finally:
        handle.remove()
    (loss,) = seen
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # DTensor under loss_parallel


def reference_validation_loss(net: nn.Module, model: ModelConfig, global_batch: int) -> float:
    """The reference's: the whole model in one process, one global batch of windows at a time."""
    batches = text.validation_offsets(model.seq, global_batch).reshape(-1, global_batch)
    total = 0.0
    with torch.no_grad():
        for offsets in batches:
            tokens, targets = data.text_batch(offsets, model.seq)
            total += float(lm_loss(net, tokens, targets))
    return total / len(batches)


def validation_share(
    rank_model, mesh, cfg: ParallelConfig, model: ModelConfig, index: int, count: int, device: torch.device
) -> float:
    """This rank's share of the validation loss: its mean loss over the validation batches (0 off
    the last pipeline stage). The global value is the sum of the tp-rank-0 shares over the data
    shards, divided by their count (dp·ep·cp), as for the training loss.

    index, count: this rank's slice of a global batch (train.data_index)."""
    batches = text.validation_offsets(model.seq, cfg.global_batch).reshape(-1, cfg.global_batch)
    # DTensor's vocab-parallel loss runs under loss_parallel(), as parallelize wraps the training schedule
    parallel_loss = nullcontext()
    if cfg.torch_impl and cfg.tp > 1:
        from torch.distributed.tensor.parallel import loss_parallel  # DTensor: only its runs load it

        parallel_loss = loss_parallel()
    total = 0.0
    with torch.no_grad(), parallel_loss:
        for offsets in batches:
            runtime.check_cancelled()
            tokens, targets = data.text_batch(offsets, model.seq)
            tokens = data.shard(tokens, index, count).to(device)
            targets = data.shard(targets, index, count).to(device)
            mbs = [rank_model.inputs(t, y) for t, y in data.microbatches(tokens, targets, cfg.microbatches)]
            if mesh.size("pp") > 1:
                seq_split = mesh.size("tp") if cfg.sequence_parallel else 1
                total += _pipeline_forward(
                    rank_model.chunks, mesh, mbs, model.hidden, cfg.precision, seq_split, style(cfg.schedule)
                )
            else:
                total += sum(float(lm_loss(rank_model.chunks[0], *mb)) for mb in mbs) / len(mbs)
    return total / len(batches)


def _pipeline_forward(chunks, mesh, mbs, hidden: int, precision: str, seq_split: int, placement: str = "loop") -> float:
    """Forward every microbatch through the pipeline; returns the last stage's mean loss (0 elsewhere).

    Each rank takes its (microbatch, chunk) pairs in the order (microbatch, virtual stage), the
    same total order on every rank, and only a receive blocks (sends are posted asynchronously and
    waited at the end): the first pair not yet done anywhere has its input sent already, so the
    forwards cannot deadlock. Activations cross in the compute dtype, s/tp rows each under SP; in a
    V (`placement` 'v') rank p-1 hands its stage p-1's output to its stage p directly."""
    p, r, v = mesh.size("pp"), mesh.coord("pp"), len(chunks)
    group, peers, last = mesh.group("pp"), mesh.ranks("pp"), p * v - 1
    b, s = mbs[0][0].shape
    device, dtype = mbs[0][0].device, policy(precision).compute
    shape = (b, s // seq_split, hidden)  # (b/m, s, h) crosses each boundary
    link = Link(group)  # one batch per message: NCCL-safe, staged through host memory under gloo + CUDA
    total, sends = 0.0, []
    for mb, (tokens, targets, positions) in enumerate(mbs):
        y = None
        for c in sorted(range(v), key=lambda c: stage_of(r, c, p, placement)):
            chunk, stage = _unwrap(chunks[c]), stage_of(r, c, p, placement)
            x = tokens
            if stage > 0 and rank_chunk_of(stage - 1, p, placement)[0] == r:
                x = y  # this rank's own previous stage
            elif stage > 0:  # tag: (microbatch, receiving stage), unique per message
                x = torch.empty(shape, dtype=dtype, device=device)
                src = peers[rank_chunk_of(stage - 1, p, placement)[0]]
                link.batch(recvs=[(x, src, mb * (last + 1) + stage)]).wait()
            if stage == last:
                total += float(lm_loss(chunk, x, targets, positions))
            else:
                y = chunk(x, None, positions).contiguous()  # (b, s, h)
                dst = rank_chunk_of(stage + 1, p, placement)[0]
                if dst != r:
                    sends.append((link.batch(sends=[(y, peers[dst], mb * (last + 1) + stage + 1)]), y))
            aux_loss(chunk)  # take off the MoE balance terms this forward recorded
    for work, _ in sends:
        work.wait()
    return total / len(mbs)
