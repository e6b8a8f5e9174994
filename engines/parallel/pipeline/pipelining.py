"""impl='torch': the same chunks through PyTorch's torch.distributed.pipelining.

Each chunk becomes a `PipelineStage` (the same virtual stage as ours: chunk·p + rank, or the V
of zbv and dualpipev), driven by ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, or the
zero-bubble ScheduleInterleavedZeroBubble (our 'zbh1': torch's ZB1P, which is ZB-H1 with one
stage per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV; the last stage returns logits and
the schedule applies `loss_fn` (the same arithmetic as model.Head) and scales the gradients by
1/m. With dp > 1 each chunk is wrapped in PyTorch's DDP, which the stage knows how to drive
(no_sync until the chunk's last backward). The gradient norm is clipped across the pipeline
the way torchtitan does it: the local norm, squared, all-reduced over pp.

What we measure: F / B / W spans come from wrapping the stage's forward_one_chunk,
backward_one_chunk (B: torch's input-gradient backward when the schedule splits it, else the
whole backward) and backward_weight_one_chunk; activations from the saved-tensor hooks around
them and around the loss; the comm meter sees the schedule's batched isend/irecv at the
dispatcher.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from labkit.config import OptimConfig
from labkit.engines.loss import cross_entropy
from labkit.engines.parallel.common import ParamMetas, all_reduce_tied, tied_params
from labkit.engines.parallel.ddp import TorchUpdate
from labkit.layout.mesh import DATA_DIMS
from labkit.layout.schedules import stage_of, style


def _schedule_class(name: str):
    # torch.distributed.pipelining takes 0.5 s to import: only impl='torch' with pp > 1 needs it
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    return {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved": ScheduleInterleaved1F1B,
        "zbh1": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
        "dualpipev": ScheduleDualPipeV,
    }[name]


class TorchSchedule:
    """schedule(rank_model, microbatches, meters) over torch.distributed.pipelining's `schedule`
    (any of labkit's: `_schedule_class`), built on first use (from rank_model.chunks, which DDP may
    have wrapped by then)."""

    def __init__(self, mesh, *, schedule: str, microbatches: int, virtual_stages: int):
        self.mesh = mesh
        self.schedule, self.microbatches, self.virtual_stages = schedule, microbatches, virtual_stages
        self.sched = None
        self.first = self.last = False

    def _build(self, rank_model, meters) -> None:
        from torch.distributed.pipelining import PipelineStage  # deferred: see _schedule_class
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti  # takes a list of stages

        p, v, r = self.mesh.size("pp"), self.virtual_stages, self.mesh.coord("pp")
        stages = []
        for c, module in enumerate(rank_model.chunks):
            index = stage_of(r, c, p, style(self.schedule))
            st = PipelineStage(module, index, p * v, meters.device, group=self.mesh.group("pp"))
            _instrument(st, c, meters)
            stages.append(st)
        self.first = any(st.is_first for st in stages)
        self.last = any(st.is_last for st in stages)

        # ModelConfig.loss, as the head holds it (the chunks may be wrapped by DDP or FSDP)
        heads = (m for c in rank_model.chunks for m in c.modules() if isinstance(getattr(m, "loss", None), str))
        how = next((m.loss for m in heads), "fp32")

        def loss_fn(logits, targets):  # model.Head's loss: (b, s, V) logits -> scalar
            with meters.memory.saved_tensors():
                return cross_entropy(logits, targets, how)

        cls = _schedule_class(self.schedule)
        self.sched = cls(
            stages if issubclass(cls, PipelineScheduleMulti) else stages[0],
            n_microbatches=self.microbatches,
            loss_fn=loss_fn,
        )

    def __call__(self, rank_model, microbatches, meters) -> float:
        if self.sched is None:
            self._build(rank_model, meters)
        tokens = torch.cat([t for t, _ in microbatches])  # m x (b/m, s) -> (b, s); the schedule splits it again
        targets = torch.cat([y for _, y in microbatches])
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.first else ()
        kwargs = {"target": targets, "losses": losses} if self.last else {}
        self.sched.step(*args, **kwargs)
        if not self.last:
            return 0.0
        meters.wait_device()
        return float(sum(l.detach().float() for l in losses)) / len(losses)


def _instrument(stage, chunk: int, meters) -> None:
    """Record the stage's forward / backward (B) / weight-gradient (W) of each microbatch on our
    timeline."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        with meters.phase("forward"), meters.span("F", fwd_chunk_id, chunk), meters.memory.saved_tensors():
            return forward(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id, *args, **kwargs):
        with meters.phase("backward"), meters.span("B", bwd_chunk_id, chunk):
            return backward(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs):
        with meters.phase("backward"), meters.span("W", bwd_chunk_id, chunk):
            return weight(bwd_chunk_id, *args, **kwargs)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


class TorchStageGrads:
    """GradSync for impl='torch' with pp > 1: PyTorch DDP per chunk over dp (when dp > 1),
    torch.optim.AdamW, and the gradient norm taken over the whole pipeline."""

    def __init__(self, chunks: list[nn.Module], mesh, metas: ParamMetas, bucket_mb: float, optim: OptimConfig):
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        self.modules = chunks
        if mesh.size(*DATA_DIMS) > 1:
            # find_unused_parameters: DDP otherwise rebuilds its buckets from the first synced
            # backward, which under the stage's no_sync + prepare_for_backward sees every
            # microbatch's gradients (2m x the parameters) and trips an internal assert.
            self.modules = [
                DistributedDataParallel(
                    c,
                    process_group=mesh.group(*DATA_DIMS),
                    bucket_cap_mb=bucket_mb,
                    gradient_as_bucket_view=True,
                    broadcast_buffers=False,
                    find_unused_parameters=True,
                )
                for c in chunks
            ]
        self.pp_group = mesh.group("pp")
        self.update = TorchUpdate(named, metas, optim)
        self.tied_group, self.tied = tied_params(self.update.params, metas, mesh)
        # a tied embedding's last-stage copy is the first stage's parameter again: counted there
        self.counted = [p for _, p in named if "pp" not in metas[p].replicas]

    def microbatch(self, index: int, count: int):
        return nullcontext()  # the pipelining schedule drives DDP's no_sync itself

    def finish(self) -> None:
        for p in self.update.params:  # a tied embedding's two copies: their gradients summed (after DDP's mean)
            if id(p) in self.tied:
                all_reduce_tied(p.grad, self.tied_group)

    def step(self) -> float:
        grads = [p.grad for p in self.counted if p.grad is not None]
        sq = torch.nn.utils.get_total_norm(grads).pow(2)  # this stage's share of ||g||^2
        dist.all_reduce(sq, group=self.pp_group)  # () summed over the pipeline
        norm = sq.sqrt()
        if self.update.clip:
            torch.nn.utils.clip_grads_with_norm_(self.update.params, self.update.clip, norm)
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
