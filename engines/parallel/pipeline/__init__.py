"""Pipeline parallelism (labkit's own): the layers split into stages that pass activations.

The model's blocks are split over pp·v virtual stages, evenly or as ParallelConfig.stage_layers
says (layout.schedules.chunk_layers); the embedding lives on the first, the final norm, LM head
and loss on the last (a tied embedding on both: `split_model`). Each rank keeps
its v chunks (`Chunk`), whose parameters keep their names in the full model (ParamMeta.name), so
DDP, clipping and the reference check work unchanged; ParamMeta.chunk tells DDP which chunk a
parameter is in, so each chunk's gradients form their own buckets and are reduced as soon as
that chunk's last backward is over.

The schedule is data (layout.schedules.schedule_table): this rank's ordered list of F / B / W / send /
recv actions. `PipelineExecutor` runs any such list, as schedules.batches issues it: the
computes in the list's order, and the sends and receives grouped into batches, one
batch_isend_irecv each (engines/p2p.py), by the unit-time tick at which their message is sent,
so that every rank's k-th batch meets only its peers' k-th batches (NCCL matches messages by
order, not by tag, and runs each group's ops one after another). A send goes out right after
the compute that made it and is waited for at the end of the step; a receive is posted with its
sender's batch and waited for right before the compute that needs it. The schedule is simulated
first, under gloo's rules and under NCCL's (layout/simulator.py), and a schedule that would hang on
either is refused with the ranks' stuck actions (ScheduleDeadlock) before anything runs.

Zero-bubble schedules (zbh1, zbv, dualpipev) split backward (engines/parallel/pipeline/split_backward.py):
B computes the input gradient and sends it at once, W the weight gradients later, from what B
kept; the data-parallel step sees the weights' gradients arrive in W. In a V (zbv, dualpipev)
rank p-1 holds stages p-1 and p, and passes the activation and its gradient between its own
two chunks without a message.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.nn as nn

from labkit.engines.meters.memory import unique_bytes
from labkit.engines.model import aux_loss
from labkit.engines.p2p import Link
from labkit.engines.parallel.common import ParamMetas
from labkit.engines.parallel.pipeline.split_backward import backward_input, backward_weight
from labkit.layout.schedules import (
    Action,
    ScheduleTable,
    batches,
    chunk_layers,
    message,
    rank_chunk_of,
    schedule_table,
    stage_of,
    style,
)
from labkit.layout.simulator import ScheduleDeadlock, check


class Chunk(nn.Module):
    """One virtual stage: [embedding] + consecutive blocks + [final norm, head and loss].

    The blocks sit in a ModuleDict keyed by their index in the full model, so the chunk's
    parameter names are the full model's ('blocks.5.attn.wq.weight')."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.head = model.head if last else None
        self.rope = model.rope if layers else None  # llama: each chunk makes its blocks' tables
        self.cfg = model.cfg
        self.seq = model.cfg.seq

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """First stage: (b, s) tokens in; others: (b, s, h) activations (s/tp rows under SP). Last
        stage: the mean loss with targets, else the logits (torch.distributed.pipelining applies
        its loss_fn). `positions`: of the sequence's tokens (a cp rank's zigzag ones), default all."""
        if positions is None:  # the first stage sees the tokens (a prompt may be shorter than seq)
            positions = torch.arange(x.shape[1] if self.embed is not None else self.seq, device=x.device)
        if self.embed is not None:
            x = self.embed(x, positions)  # (b, s) -> (b, s, h)
        rope = self.rope(positions, x.dtype) if self.rope is not None else None  # 2 x (s, hd)
        for block in self.blocks.values():
            x = block(x, rope)  # (b, s, h) -> (b, s, h)
        if self.head is None:
            return x
        if targets is None:
            return self.head.proj(self.head.norm(x))  # (b, s, h) -> (b, s, V)
        return self.head(x, targets)  # scalar


def split_model(
    model: nn.Module,
    metas: ParamMetas,
    p: int,
    v: int,
    rank: int,
    stage_layers: tuple[int, ...] = (),
    placement: str = "loop",
) -> list[Chunk]:
    """This pipeline rank's v chunks of the full (seeded) model (`placement`: schedules.style),
    each parameter's full name and chunk recorded in `metas`.

    A tied embedding (gpt2, Llama 3.2) has two copies: the embedding on the first stage and the
    head on the last, each under the one full name; the last stage's is marked a replica over pp
    (the norm counts the first's) and both `tied`: their gradients are all-reduced over the
    two stages before the update (`tied_params`), so they stay equal, as in Megatron-LM."""
    for name, prm in model.named_parameters():
        if metas[prm].name is None:
            metas[prm].name = name
    chunks = []
    tied = model.head.proj.weight if model.cfg.tied and p > 1 else None
    for c in range(v):
        s = stage_of(rank, c, p, placement)
        layers = chunk_layers(len(model.blocks), p, v, rank, c, stage_layers, placement)
        chunk = Chunk(model, layers, first=s == 0, last=s == p * v - 1)
        for prm in chunk.parameters():
            metas[prm].chunk = c
        if tied is not None and (chunk.embed is not None or chunk.head is not None):
            metas[tied].tied = True
            if chunk.head is not None:
                metas[tied].replicas += ("pp",)
        chunks.append(chunk)
    return chunks


def apply_pipeline(
    model: nn.Module,
    mesh,
    metas: ParamMetas,
    *,
    virtual_stages: int,
    stage_layers: tuple[int, ...] = (),
    schedule: str = "1f1b",
) -> tuple[list[Chunk], dict]:
    """Slot 5 of parallelize: (this pp rank's chunks, its stage and layers as data for the report).
    The schedule that runs them is built apart: `PipelineExecutor`, or pipeline/pipelining.py's TorchSchedule;
    `schedule` says where the chunks sit (a V for zbv and dualpipev)."""
    p, v, r, placement = mesh.size("pp"), virtual_stages, mesh.coord("pp"), style(schedule)
    layers = [list(chunk_layers(len(model.blocks), p, v, r, c, stage_layers, placement)) for c in range(v)]
    chunks = split_model(model, metas, p, v, r, stage_layers, placement)
    return chunks, {"p": p, "v": v, "stage": r, "layers": layers}


def pipeline_executor(
    mesh, *, schedule: str, microbatches: int, virtual_stages: int, hidden: int, dtype: torch.dtype, seq_split: int
) -> PipelineExecutor:
    """Our executor of `schedule` (any of schedules.SCHEDULES) for this pp rank: the schedule is built
    (schedules.schedule_table), simulated and refused if it would hang, then run as is."""
    return PipelineExecutor(
        schedule_table(schedule, mesh.size("pp"), microbatches, virtual_stages), mesh, hidden, dtype, seq_split
    )


class PipelineExecutor:
    """schedule(rank_model, microbatches, meters) -> this rank's share of the loss, running this rank's
    actions of a ScheduleTable. The share: the last stage's mean loss over the microbatches, 0 elsewhere
    (plus the MoE load-balancing loss of the layers a stage holds)."""

    def __init__(self, table: ScheduleTable, mesh, hidden: int, dtype: torch.dtype = torch.float32, seq_split: int = 1):
        found = check(table)
        if found:
            raise ScheduleDeadlock(found)
        self.table = table
        self.rank = mesh.coord("pp")
        self.actions = table.actions[self.rank]
        self.items = batches(table)[self.rank]  # computes, and the batches of sends and receives between them
        self.link = Link(mesh.group("pp"))
        self.peers = mesh.ranks("pp")  # pipeline rank -> global rank (sorted = by pp coordinate)
        self.hidden = hidden
        self.dtype = dtype  # what stages pass: activations and gradients in the compute dtype
        self.seq_split = seq_split  # sequence parallelism: each tp rank passes its rs/tp rows
        self.split = any(a.op == "W" for a in self.actions)
        # a V's turn: the chunk of this rank that holds the stage before (after) each chunk's, if any
        self.own_before, self.own_after = {}, {}
        for c in range(table.v):
            s = table.stage(self.rank, c)
            for nb, into in ((s - 1, self.own_before), (s + 1, self.own_after)):
                if 0 <= nb < table.p * table.v:
                    q, qc = rank_chunk_of(nb, table.p, table.style)
                    if q == self.rank:
                        into[c] = qc

    def _tag(self, a) -> int:
        """One tag per message, the same on both sides: (microbatch, receiving stage, kind)."""
        kind, mb, to = message(self.table, self.rank, a)
        return (mb * self.table.p * self.table.v + to) * 2 + (0 if kind == "act" else 1)

    def _post(self, batch: tuple, outputs: dict, inputs: dict, arriving: dict, shape, meters):
        """Post one batch: the sends (the activation of a forward just run, or the input gradient
        of a backward) and the receives, whose buffers wait in `arriving` until needed."""
        sends, recvs, sending, receiving = [], [], [], []
        for a in batch:
            peer = self.peers[a.peer]
            if a.op.startswith("recv"):
                buf = torch.empty(shape, dtype=self.dtype, device=meters.device)  # (b, s, h)
                recvs.append((buf, peer, self._tag(a)))
                receiving.append((a, buf))
            else:
                key = (a.mb, a.chunk)
                t = outputs[key][0].detach() if a.op == "send_act" else inputs.pop(key).grad
                sends.append((t, peer, self._tag(a)))
                sending.append(a)
        # the batch is logged in one phase: that of what it sends (after F forward, after B backward)
        first = (sending or batch)[0]
        with meters.phase("forward" if first.op.endswith("act") else "backward"), ExitStack() as spans:
            for a in sending:
                spans.enter_context(meters.span("send", a.mb, a.chunk, peer=self.peers[a.peer]))
            exchange = self.link.batch(sends, recvs)
        for a, buf in receiving:
            arriving[(a.op, a.mb, a.chunk)] = (a, buf, exchange)
        return exchange

    def _take(self, arriving: dict, op: str, mb: int, chunk: int, meters) -> torch.Tensor | None:
        """The buffer of the receive `op` of (mb, chunk), waited for; None if there is none."""
        got = arriving.pop((op, mb, chunk), None)
        if got is None:
            return None
        a, buf, exchange = got
        with (
            meters.phase("forward" if op == "recv_act" else "backward"),
            meters.span("recv", mb, chunk, peer=self.peers[a.peer]),
        ):
            exchange.wait_recvs()
        return buf

    def __call__(self, rank_model, microbatches, meters) -> float:
        m = len(microbatches)
        if m != self.table.m:
            raise ValueError(f"the schedule is for {self.table.m} microbatches, the step has {m}")
        mbs = [rank_model.inputs(tokens, targets) for tokens, targets in microbatches]
        b, s = mbs[0][0].shape
        shape = (b, s // self.seq_split, self.hidden)  # (b/m, s, h) crosses each boundary (s/tp under SP)
        inputs, outputs, arriving, posted, kept = {}, {}, {}, [], {}
        backwards_done = [0] * self.table.v
        share = torch.zeros((), device=meters.device)
        # (no tensor of a microbatch is held in a local variable between actions: under split
        # backward its graph must go when W drops it, which is when the memory meter sees it go)
        for a in self.items:
            meters.check_cancelled()
            if not isinstance(a, Action):  # a batch of sends and receives
                posted.append(self._post(a, outputs, inputs, arriving, shape, meters))
                continue
            key = (a.mb, a.chunk)
            chunk = rank_model.chunks[a.chunk]
            if a.op == "F":
                x = self._take(arriving, "recv_act", a.mb, a.chunk, meters)
                if a.chunk in self.own_before:  # a V's turn: the output of this rank's stage before
                    x = outputs[(a.mb, self.own_before[a.chunk])][0].detach()
                if x is not None:
                    inputs[key] = x.requires_grad_()
                del x
                with meters.phase("forward"), meters.span("F", a.mb, a.chunk), meters.memory.saved_tensors():
                    outputs[key] = self._forward(chunk, inputs.get(key), mbs[a.mb])
                share = share + outputs[key][2]
            elif a.op == "B":
                if chunk.head is None and a.chunk in self.own_after:  # a V's turn: from this rank's stage after
                    seed = inputs.pop((a.mb, self.own_after[a.chunk])).grad
                elif chunk.head is None:
                    seed = self._take(arriving, "recv_grad", a.mb, a.chunk, meters)
                else:
                    seed = None
                roots = self._roots(outputs.pop(key), seed, m)
                del seed
                if self.split:  # the input gradient now, the weights' in W (from what B keeps)
                    with meters.phase("backward"), meters.span("B", a.mb, a.chunk):
                        kept[key] = backward_input(*roots, [inputs[key]] if key in inputs else [], chunk.parameters())
                    del roots
                    kept[key].nbytes = unique_bytes(kept[key].held())
                    meters.memory.track("held_for_w", kept[key].nbytes)
                    continue
                # the chunk's last backward (by count, whatever the order) lets DDP reduce it
                with (
                    meters.phase("backward"),
                    meters.span("B", a.mb, a.chunk),
                    rank_model.grads.microbatch(backwards_done[a.chunk], m),
                ):
                    torch.autograd.backward(*roots)
                del roots
                backwards_done[a.chunk] += 1
            else:  # W: the weights' gradients, which the data-parallel step sees arrive
                deferred = kept.pop(key)
                with (
                    meters.phase("backward"),
                    meters.span("W", a.mb, a.chunk),
                    rank_model.grads.microbatch(backwards_done[a.chunk], m),
                ):
                    backward_weight(deferred)
                meters.memory.track("held_for_w", -deferred.nbytes)
                del deferred
                backwards_done[a.chunk] += 1
        with meters.phase("backward"):
            for exchange in posted:
                exchange.wait()
        meters.wait_device()
        return float(share) / m

    @staticmethod
    def _forward(chunk, x, mb) -> tuple:
        """(output, MoE balance loss, this forward's part of the rank's loss share): the last stage
        returns its mean loss (targets given), the others the activation it passes on."""
        tokens, targets, positions = mb
        y = chunk(tokens if x is None else x, targets if chunk.head is not None else None, positions)
        aux = aux_loss(chunk)
        part = aux.detach() if isinstance(aux, torch.Tensor) else torch.zeros((), device=y.device)
        if chunk.head is not None:
            part = part + y.detach().float()
        return y, aux, part

    @staticmethod
    def _roots(forward: tuple, seed, m: int) -> tuple[list, list]:
        """(tensors, their seeds) that a backward starts from. The loss of the step is the mean
        over microbatches: each backward carries 1/m of the last stage's loss and of the MoE
        balance loss."""
        y, aux, _ = forward
        if seed is None:  # the last stage: its loss
            return [(y + aux) / m], [None]
        if isinstance(aux, torch.Tensor):
            return [y, aux / m], [seed, None]
        return [y], [seed]
