"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs.

Pure Python (no torch): the executor (engines/parallel/pipeline.py), the simulator
(simulator.py), the theory (labkit/theory/pipeline.py) and the widgets all read the same lists.
(engines/accumulate.py is something else: the pp == 1 gradient-accumulation loop.)

An action is a forward `F`, a backward `B` (or, split as in zero-bubble schedules, an
input-gradient `B` and a weight-gradient `W`) of microbatch `mb` on local chunk `chunk`, or a
point-to-point op: `send_act` / `recv_act` (activations, forward direction) and `send_grad` /
`recv_grad` (gradients of those activations, backward direction) with the `peer` rank.

Layers are split into p·v virtual stages, of equal size or as `stage_layers` lists. Rank r
holds chunks c = 0..v-1, which are virtual stages c·p + r (Megatron's interleaved assignment,
Narayanan et al., SC 2021, section 2.2): activations go rank 0 -> 1 -> ... -> p-1 -> 0 (next
chunk) -> ... Every schedule is defined by its *compute order* (F/B/W per rank); the sends and
receives are derived from it (`with_comm`): a receive right before the compute that needs it, a
send right after the compute that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


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
class Plan:
    """Every rank's actions for one step: `actions[r]` is pipeline rank r's ordered list."""

    schedule: str
    p: int
    m: int
    v: int
    actions: tuple[tuple[Action, ...], ...]

    def stage(self, rank: int, chunk: int) -> int:
        return stage_of(rank, chunk, self.p)

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
    def from_dict(cls, d: dict) -> Plan:
        return cls(
            d["schedule"], d["p"], d["m"], d["v"], tuple(tuple(Action(*a) for a in acts) for acts in d["actions"])
        )


# -- where the layers live ---------------------------------------------------------------------
def stage_of(rank: int, chunk: int, p: int) -> int:
    """The virtual stage of `chunk` on pipeline rank `rank` (Megatron: chunk·p + rank)."""
    return chunk * p + rank


def rank_chunk_of(stage: int, p: int) -> tuple[int, int]:
    return stage % p, stage // p


def stage_sizes(layers: int, stages: int, stage_layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Blocks per virtual stage, in stage order: `stage_layers` when given (uneven stages,
    ParallelConfig.stage_layers), else `layers` split evenly over `stages`."""
    return tuple(stage_layers) if stage_layers else (layers // stages,) * stages


def chunk_layers(layers: int, p: int, v: int, rank: int, chunk: int, stage_layers: tuple[int, ...] = ()) -> range:
    """Block indices of one chunk: the blocks in order, virtual stage s taking the next
    stage_sizes(...)[s] of them (an even split unless `stage_layers` says otherwise)."""
    sizes = stage_sizes(layers, p * v, stage_layers)
    s = stage_of(rank, chunk, p)
    start = sum(sizes[:s])
    return range(start, start + sizes[s])


# -- compute orders (one list of (op, mb, chunk) per rank) --------------------------------------
def gpipe_order(p: int, m: int, rank: int) -> list[tuple]:
    """GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards (in microbatch order,
    as torch's ScheduleGPipe). Every microbatch's activations are in flight at once."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b_order(p: int, m: int, rank: int) -> list[tuple]:
    """1F1B / PipeDream-Flush (Narayanan et al., SC 2021, section 2.1): warm up with p-rank-1
    forwards, then alternate one forward and one backward, then drain the backwards. The same
    bubble as GPipe, but at most p - rank microbatches in flight."""
    warm = min(p - rank - 1, m)
    order = [("F", i, 0) for i in range(warm)]  # warmup
    for i in range(m - warm):  # steady state
        order += [("F", warm + i, 0), ("B", i, 0)]
    order += [("B", i, 0) for i in range(m - warm, m)]  # cooldown
    return order


def _interleaved_id(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) on a rank, as Megatron's
    get_model_chunk_id: groups of p microbatches visit the chunks in turn."""
    chunk = (k // p) % v
    mb = (k // (p * v)) * p + k % p
    return mb, (chunk if forward else v - 1 - chunk)


def interleaved_order(p: int, m: int, v: int, rank: int) -> list[tuple]:
    """Interleaved 1F1B (Narayanan et al., SC 2021, section 2.2; Megatron-LM's
    forward_backward_pipelining_with_interleaving): v chunks per rank, microbatches taken in
    groups of p; warmup (p - rank - 1)·2 + (v - 1)·p forwards, then 1F1B, then cooldown.
    The bubble shrinks by v: (p-1)/(v·m + p-1). Needs m % p == 0."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({p})")
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    f = [("F", *_interleaved_id(k, p, v, True)) for k in range(total)]
    b = [("B", *_interleaved_id(k, p, v, False)) for k in range(total)]
    order = f[:warm]
    for k in range(total - warm):
        order += [f[warm + k], b[k]]
    return order + b[total - warm :]


def zb_h1_order(p: int, m: int, rank: int) -> list[tuple]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B with
    each backward split into B (input gradient, on the critical path) and W (weight gradient,
    free to move). Rank r runs its W's r slots late, so the last ranks send their B's upstream
    without waiting for their W's, and the W's fill the cooldown. At most min(m, p)
    microbatches in flight on any rank (1F1B's peak, on rank 0). With t_F = t_B = t_W and
    m >= p, the step takes 3m + p - 1 units: the bubble (p-1)(t_F + t_B - t_W) of the paper's
    table 2, a third of 1F1B's (p-1)(t_F + t_B + t_W). (The executor does not split backward;
    this one is for the simulator and the figures.)"""
    warm = min(p - rank - 1, m)
    order = [("F", i, 0) for i in range(warm)]
    w = 0
    for i in range(m - warm):
        order += [("F", warm + i, 0), ("B", i, 0)]
        if i >= rank:  # W of an older microbatch, `rank` slots late
            order.append(("W", w, 0))
            w += 1
    for i in range(m - warm, m):  # cooldown: each B, then the oldest W pending
        order += [("B", i, 0), ("W", w, 0)]
        w += 1
    return order + [("W", i, 0) for i in range(w, m)]


def compute_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple]:
    if schedule == "interleaved":
        return interleaved_order(p, m, v, rank)
    if v != 1:
        raise ValueError(f"schedule {schedule!r} has one chunk per rank; virtual_stages={v} needs 'interleaved'")
    orders = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb-h1": zb_h1_order}
    if schedule not in orders:
        raise ValueError(f"unknown schedule {schedule!r}; known: {list(SCHEDULES)}")
    return orders[schedule](p, m, rank)


def with_comm(order: list[tuple], p: int, v: int, rank: int) -> list[Action]:
    """Insert the point-to-point ops around a rank's compute order."""
    last = p * v - 1
    out: list[Action] = []
    for op, mb, c in order:
        s = stage_of(rank, c, p)
        if op == "F":
            if s > 0:
                out.append(Action("recv_act", mb, c, rank_chunk_of(s - 1, p)[0]))
            out.append(Action("F", mb, c))
            if s < last:
                out.append(Action("send_act", mb, c, rank_chunk_of(s + 1, p)[0]))
        elif op == "B":
            if s < last:
                out.append(Action("recv_grad", mb, c, rank_chunk_of(s + 1, p)[0]))
            out.append(Action("B", mb, c))
            if s > 0:
                out.append(Action("send_grad", mb, c, rank_chunk_of(s - 1, p)[0]))
        else:
            out.append(Action(op, mb, c))
    return out


def plan(schedule: str, p: int, m: int, v: int = 1) -> Plan:
    """Every pipeline rank's actions for one step of `schedule` with p ranks, m microbatches and
    v chunks per rank."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p={p}, m={m}, v={v} must all be >= 1")
    acts = tuple(tuple(with_comm(compute_order(schedule, p, m, v, r), p, v, r)) for r in range(p))
    return Plan(schedule, p, m, v, acts)


def message(pl: Plan, rank: int, a: Action) -> tuple:
    """Which message a send or receive of `rank` carries: (kind, microbatch, receiving virtual
    stage), the same on both sides (the executor's tag, the simulator's key)."""
    s = stage_of(rank, a.chunk, pl.p)
    if a.op == "send_act":
        return ("act", a.mb, s + 1)
    if a.op == "recv_act":
        return ("act", a.mb, s)
    if a.op == "send_grad":
        return ("grad", a.mb, s - 1)
    return ("grad", a.mb, s)  # recv_grad


def batches(pl: Plan) -> tuple[list, ...]:
    """Every rank's list as the executor issues it: its compute actions in the plan's order, and
    between them its sends and receives grouped into batches (each one batch_isend_irecv, one
    NCCL group call) by tick: the unit-time step (F = B = W = 1) at which the sending compute
    ends. Tick t's batch on a rank holds the sends of the compute it ran at t and the receives of
    every message its peers send at t, so the k-th batch of a rank meets only k-th batches of its
    peers — torch.distributed.pipelining's lockstep (PipelineScheduleMulti issues each time
    step's sends and receives as one batch_isend_irecv). Receives are thus posted as soon as
    their message is sent, and waited for only before the compute that needs them; sends still go
    right after the compute that produced them. (Batching only each run of neighbouring sends and
    receives is not enough under NCCL: interleaved 1F1B then hangs, tests/test_schedules.py.)
    An item is an Action (compute) or a tuple of Actions (a batch). Needs a plan that completes
    (simulator.check)."""
    p = pl.p
    steps = []  # per rank: [compute, receives it waits for, sends it makes]
    for acts in pl.actions:
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
                keys = [message(pl, r, x) for x in needs]
                if any(k not in sent for k in keys):
                    break
                t = max([free[r]] + [sent[k] + 1 for k in keys])
                tick_of[r].append(t)
                free[r] = t + 1
                for x in sends:
                    sent[message(pl, r, x)] = t
                moved = True
    if any(len(tick_of[r]) < len(steps[r]) for r in range(p)):
        raise ValueError(f"plan {pl.schedule} p={p} m={pl.m} does not complete; simulator.check says why")
    out = []
    for r in range(p):
        recv_at: dict[int, list[Action]] = {}  # tick -> receives whose message is sent then
        for _, needs, _ in steps[r]:
            for x in needs:
                recv_at.setdefault(sent[message(pl, r, x)], []).append(x)
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
def local_problems(pl: Plan) -> list[str]:
    """What each rank's own list gets wrong: every (mb, chunk) has one F then one B (then one W
    if backward is split); a receive before the compute that needs it, a send after the one that
    produced it, to and from the right peers. (Cross-rank ordering is the simulator's job:
    simulator.check runs both.)"""
    out = []
    last = pl.p * pl.v - 1
    for r, acts in enumerate(pl.actions):
        done: dict[tuple, set] = {}
        split = any(a.op == "W" for a in acts)
        for a in acts:
            key = (a.mb, a.chunk)
            have = done.setdefault(key, set())
            s = pl.stage(r, a.chunk)
            need = {
                "F": {"recv_act"} if s > 0 else set(),
                "B": {"F"} | ({"recv_grad"} if s < last else set()),
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
            if a.op in ("send_act", "recv_grad"):
                want = rank_chunk_of(s + 1, pl.p)[0] if s < last else None
                if a.peer != want:
                    out.append(f"rank {r}: {a} should talk to rank {want}")
            if a.op in ("recv_act", "send_grad"):
                want = rank_chunk_of(s - 1, pl.p)[0] if s > 0 else None
                if a.peer != want:
                    out.append(f"rank {r}: {a} should talk to rank {want}")
            have.add(a.op)
        for c in range(pl.v):
            for i in range(pl.m):
                have = done.get((i, c), set())
                want = {"F", "B"} | ({"W"} if split else set())
                if not want <= have:
                    out.append(f"rank {r}: microbatch {i} chunk {c} lacks {sorted(want - have)}")
    return out
