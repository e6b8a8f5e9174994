"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs.

Pure Python (no torch): the executor (engines/parallel/pipeline/), the simulator
(simulator.py), the theory (labkit/theory/exact/pipeline.py) and the widgets all read the same lists.
(engines/accumulate.py is something else: the pp == 1 gradient-accumulation loop.)

An action is a forward `F`, a backward `B` (or, split as in zero-bubble schedules, an
input-gradient `B` and a weight-gradient `W`) of microbatch `mb` on local chunk `chunk`, or a
point-to-point op: `send_act` / `recv_act` (activations, forward direction) and `send_grad` /
`recv_grad` (gradients of those activations, backward direction) with the `peer` rank.

Layers are split into p·v virtual stages, of equal size or as `stage_layers` lists. Rank r
holds chunks c = 0..v-1. In the 'loop' placement they are virtual stages c·p + r (Megatron's
interleaved assignment, Narayanan et al., SC 2021, section 2.2): activations go rank 0 -> 1 ->
... -> p-1 -> 0 (next chunk) -> ... The V-shaped schedules (ZB-V, DualPipeV) place chunk 0 on
stage r and chunk 1 on stage 2p-1-r ('v', torch's generate_stage_to_rank_mapping style="v"):
activations go down the ranks and back up, so rank p-1 hands stage p-1's output to its own
stage p without a message, and rank 0 holds both the embedding and the head. Every schedule is
defined by its *compute order* (F/B/W per rank, layout/orders.py); the sends and receives are
derived from it (`with_comm`): a receive right before the compute that needs it, a send right
after the compute that produced it, none between two stages of one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from labkit.config.choices import SCHEDULES, pipeline_shape
from labkit.layout.orders import (
    dualpipev_order,
    gpipe_order,
    interleaved_order,
    one_f_one_b_order,
    zbh1_order,
    zbv_order,
)

COMPUTE = ("F", "B", "W")


def style(schedule: str) -> str:
    """'v' for the V-shaped schedules' placement of chunks on stages (PipelineShape.v_shaped,
    labkit/config/choices.py), 'loop' for every other, a schedule written by hand included."""
    return "v" if schedule in SCHEDULES and pipeline_shape(schedule).v_shaped else "loop"


class Action(NamedTuple):
    op: str
    """'F' | 'B' | 'W' | 'send_act' | 'recv_act' | 'send_grad' | 'recv_grad'"""
    mb: int
    chunk: int = 0
    peer: int | None = None

    def __str__(self) -> str:
        where = f"{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")
        if self.peer is None:
            return where
        return f"{where}{'->' if self.op.startswith('send') else '<-'}r{self.peer}"


@dataclass(frozen=True)
class ScheduleTable:
    """Every rank's actions for one step: `actions[r]` is pipeline rank r's ordered list."""

    schedule: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def style(self) -> str:
        return style(self.schedule)

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.p, self.style)

    def rank_of(self, stage: int) -> int:
        return rank_chunk_of(stage, self.p, self.style)[0]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.op in COMPUTE]

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "p": self.p,
            "m": self.m,
            "v": self.v,
            "actions": [[list(a) for a in acts] for acts in self.actions],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ScheduleTable:
        return cls(
            d["schedule"], d["p"], d["m"], d["v"], tuple(tuple(Action(*a) for a in acts) for acts in d["actions"])
        )


# -- where the layers live ---------------------------------------------------------------------
def stage_of(rank: int, chunk: int, p: int, placement: str = "loop") -> int:
    """The virtual stage of `chunk` on pipeline rank `rank`: chunk·p + rank (Megatron's loop), or
    in a V (`placement` 'v', two chunks) rank for chunk 0 and 2p - 1 - rank for chunk 1."""
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def rank_chunk_of(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, chunk) holding virtual `stage` (the inverse of stage_of)."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def stage_sizes(layers: int, stages: int, stage_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Blocks per virtual stage, in stage order: `stage_layers` when given (uneven stages,
    ParallelConfig.stage_layers), else `layers` split evenly over `stages`."""
    return tuple(stage_layers) if stage_layers else (layers // stages,) * stages


def chunk_layers(
    layers: int, p: int, v: int, rank: int, chunk: int, stage_layers: tuple[int, ...] = (), placement: str = "loop"
) -> range:
    """Block indices of one chunk: the blocks in order, virtual stage s taking the next
    stage_sizes(...)[s] of them (an even split unless `stage_layers` says otherwise)."""
    sizes = stage_sizes(layers, p * v, stage_layers)
    s = stage_of(rank, chunk, p, placement)
    start = sum(sizes[:s])
    return range(start, start + sizes[s])


# -- compute orders (layout/orders.py: one list of (op, mb, chunk) per rank) ------------------------
ORDERS = {  # by name; interleaved takes v as well
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "zbh1": zbh1_order,
    "zbv": zbv_order,
    "dualpipev": dualpipev_order,
}


def compute_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {list(SCHEDULES)}")
    shape = pipeline_shape(schedule)
    if shape.interleaved:
        return interleaved_order(p, m, v, rank)
    want = 2 if shape.v_shaped else 1
    if v != want:
        raise ValueError(f"schedule {schedule!r} has {want} chunk(s) per rank, not virtual_stages={v}")
    return ORDERS[schedule](p, m, rank)


def with_comm(order: list[tuple], p: int, v: int, rank: int, placement: str = "loop") -> list[Action]:
    """Insert the point-to-point ops around a rank's compute order (none where the neighbouring
    stage is this rank's own: a V's turn at rank p-1)."""
    last = p * v - 1

    def peer(stage: int) -> int | None:
        q = rank_chunk_of(stage, p, placement)[0]
        return None if q == rank else q

    out: list[Action] = []
    for op, mb, c in order:
        s = stage_of(rank, c, p, placement)
        before = peer(s - 1) if s > 0 else None
        after = peer(s + 1) if s < last else None
        if op == "F":
            if before is not None:
                out.append(Action("recv_act", mb, c, before))
            out.append(Action("F", mb, c))
            if after is not None:
                out.append(Action("send_act", mb, c, after))
        elif op == "B":
            if after is not None:
                out.append(Action("recv_grad", mb, c, after))
            out.append(Action("B", mb, c))
            if before is not None:
                out.append(Action("send_grad", mb, c, before))
        else:
            out.append(Action(op, mb, c))
    return out


def schedule_table(schedule: str, p: int, m: int, v: int = 1) -> ScheduleTable:
    """Every pipeline rank's actions for one step of `schedule` with p ranks, m microbatches and
    v chunks per rank."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p={p}, m={m}, v={v} must all be >= 1")
    placement = style(schedule)
    acts = tuple(tuple(with_comm(compute_order(schedule, p, m, v, r), p, v, r, placement)) for r in range(p))
    return ScheduleTable(schedule, p, m, v, acts)


def message(table: ScheduleTable, rank: int, a: Action) -> tuple:
    """Which message a send or receive of `rank` carries: (kind, microbatch, receiving virtual
    stage), the same on both sides (the executor's tag, the simulator's key)."""
    s = table.stage(rank, a.chunk)
    if a.op == "send_act":
        return ("act", a.mb, s + 1)
    if a.op == "recv_act":
        return ("act", a.mb, s)
    if a.op == "send_grad":
        return ("grad", a.mb, s - 1)
    return ("grad", a.mb, s)  # recv_grad


def batches(table: ScheduleTable) -> tuple[list, ...]:
    """Every rank's list as the executor issues it: its compute actions in the schedule's order, and
    between them its sends and receives grouped into batches (each one batch_isend_irecv, one
    NCCL group call) by tick: the unit-time step (F = B = W = 1) at which the sending compute
    ends. Tick t's batch on a rank holds the sends of the compute it ran at t and the receives of
    every message its peers send at t, so the k-th batch of a rank meets only k-th batches of its
    peers — torch.distributed.pipelining's lockstep (PipelineScheduleMulti issues each time
    step's sends and receives as one batch_isend_irecv). Receives are thus posted as soon as
    their message is sent, and waited for only before the compute that needs them; sends still go
    right after the compute that produced them. (Batching only each run of neighbouring sends and
    receives is not enough under NCCL: interleaved 1F1B then hangs, tests/test_schedules.py.)
    An item is an Action (compute) or a tuple of Actions (a batch). Needs a schedule that completes
    (simulator.check)."""
    p = table.p
    steps = []  # per rank: [compute, receives it waits for, sends it makes]
    for acts in table.actions:
        mine, waiting = [], []
        for a in acts:
            if a.op in COMPUTE:
                mine.append([a, waiting, []])
                waiting = []
            elif a.op.startswith("recv"):
                waiting.append(a)
            else:
                mine[-1][2].append(a)
        steps.append(mine)
    sent: dict[tuple, int] = {}  # message -> tick of the compute that sent it
    tick_of: list[list[int]] = [[] for _ in range(p)]
    free = [0] * p  # the first tick at which each rank is free
    moved = True
    while moved:  # unit-cost dataflow: a compute starts once its rank is free and its inputs were sent
        moved = False
        for r in range(p):
            while len(tick_of[r]) < len(steps[r]):
                a, needs, sends = steps[r][len(tick_of[r])]
                keys = [message(table, r, x) for x in needs]
                if any(k not in sent for k in keys):
                    break
                t = max([free[r]] + [sent[k] + 1 for k in keys])
                tick_of[r].append(t)
                free[r] = t + 1
                for x in sends:
                    sent[message(table, r, x)] = t
                moved = True
    if any(len(tick_of[r]) < len(steps[r]) for r in range(p)):
        raise ValueError(f"schedule {table.schedule} p={p} m={table.m} does not complete; simulator.check says why")
    out = []
    for r in range(p):
        recv_at: dict[int, list[Action]] = {}  # tick -> receives whose message is sent then
        for _, needs, _ in steps[r]:
            for x in needs:
                recv_at.setdefault(sent[message(table, r, x)], []).append(x)
        computes = dict(zip(tick_of[r], steps[r]))
        items: list = []
        for t in range(max(free) + 1):
            sends = []
            if t in computes:
                items.append(computes[t][0])
                sends = computes[t][2]
            batch = tuple(sends) + tuple(recv_at.get(t, ()))
            if batch:
                items.append(batch)
        out.append(items)
    return tuple(out)


# -- checks -------------------------------------------------------------------------------------
def local_problems(table: ScheduleTable) -> list[str]:
    """What each rank's own list gets wrong: every (mb, chunk) has one F then one B (then one W
    if backward is split); a receive before the compute that needs it, a send after the one that
    produced it, to and from the right peers; between two stages of one rank (a V's turn), the
    earlier stage's F before the later's and the later's B before the earlier's. (Cross-rank
    ordering is the simulator's job: simulator.check runs both.)"""
    out = []
    last = table.p * table.v - 1
    for r, acts in enumerate(table.actions):
        done: dict[tuple, set] = {}
        split = any(a.op == "W" for a in acts)

        def neighbour(stage: int, r: int = r) -> tuple[int | None, int | None]:
            """(the peer rank, or None if the stage is this rank's own; its chunk here)."""
            q, c = rank_chunk_of(stage, table.p, table.style)
            return (None, c) if q == r else (q, None)

        for a in acts:
            key = (a.mb, a.chunk)
            have = done.setdefault(key, set())
            s = table.stage(r, a.chunk)
            before = neighbour(s - 1) if s > 0 else (None, None)
            after = neighbour(s + 1) if s < last else (None, None)
            need = {
                "F": {"recv_act"} if before[0] is not None else set(),
                "B": {"F"} | ({"recv_grad"} if after[0] is not None else set()),
                "W": {"B"},
                "send_act": {"F"},
                "send_grad": {"B"},
                "recv_act": set(),
                "recv_grad": {"F"},
            }
            if a.op not in need:
                out.append(f"rank {r}: unknown action {a}")
                continue
            if a.op in have:
                out.append(f"rank {r}: {a} appears twice")
            missing = need[a.op] - have
            if missing:
                out.append(f"rank {r}: {a} comes before {sorted(missing)} of microbatch {a.mb} chunk {a.chunk}")
            local = {"F": before[1], "B": after[1]}.get(a.op)  # the own stage this one waits for
            if local is not None and a.op not in done.get((a.mb, local), set()):
                out.append(f"rank {r}: {a} comes before {a.op}{a.mb}.{local}, whose output it takes")
            if a.op in ("send_act", "recv_grad") and a.peer != after[0]:
                out.append(f"rank {r}: {a} should talk to rank {after[0]}")
            if a.op in ("recv_act", "send_grad") and a.peer != before[0]:
                out.append(f"rank {r}: {a} should talk to rank {before[0]}")
            have.add(a.op)
        for c in range(table.v):
            for i in range(table.m):
                have = done.get((i, c), set())
                want = {"F", "B"} | ({"W"} if split else set())
                if not want <= have:
                    out.append(f"rank {r}: microbatch {i} chunk {c} lacks {sorted(want - have)}")
    return out
