"""Run a pipeline schedule on paper: the ideal timeline, the bubble, the activations in flight, and
whether it would deadlock. Pure Python, no processes; fast enough for p = 64, m = 256.

Two sets of rules, one per backend, because a schedule must complete under both:
  gloo (`simulate`): each rank executes its list in order, one action at a time. A compute action
    (F/B/W) takes its cost; a send is posted and the rank goes on, the message arriving `comm`
    later; a receive waits until its message has arrived (tags match messages). Every action
    starts at max(end of the rank's previous action, arrival of what it receives) — a dataflow
    with one answer whatever order the ranks are stepped in. With `blocking_sends=True` a send
    waits until the peer reaches the matching receive (a rendezvous): the naive 1F1B list then
    deadlocks.
  NCCL (`simulate_nccl`): what ProcessGroupNCCL does with the executor's batches
    (schedules.slots: each run of sends and receives posted as one batch_isend_irecv). Every op
    of a group's communicator sits on one serialized queue (PyTorch serializes p2p with every
    other op of the group once it is eagerly initialized, PRs #129147 / #132900); a batch is one
    NCCL group call, which completes when every send and receive in it has met its partner, each
    partner being in the batch at the head of its peer's queue (ncclSend blocks until the receive
    runs; NCCL docs, "Point-to-point communication" and "Group calls"); tags are ignored, so the
    k-th send from a to b is the k-th receive on b from a (ProcessGroupNCCL::send(..., int
    /* unused */)), and a schedule whose k-th messages differ is refused, since NCCL would deliver
    one in the other's place.
When no rank can move and some have actions left, the schedule would hang: the result lists what
each stuck rank waits for, and nothing is run. `check` is what the executor asks before it runs
a schedule: the schedule's local mistakes (schedules.local_problems), then both simulations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from labkit.layout.schedules import COMPUTE, Action, ScheduleTable, batches, local_problems, message


@dataclass(frozen=True)
class Costs:
    """Seconds (or units) per action: a float, or a dict rank -> float (measured per rank)."""

    F: float | dict = 1.0
    B: float | dict = 1.0
    W: float | dict = 1.0
    comm: float | dict = 0.0
    """Latency of one point-to-point message, from the send to its arrival."""
    scale: dict | None = None
    """{(rank, chunk): factor} on that chunk's F/B/W: uneven stages (ParallelConfig.stage_layers)
    cost in proportion to their layers (theory/exact/pipeline.py `stage_scale`)."""

    def of(self, op: str, rank: int) -> float:
        c = getattr(self, op if op in COMPUTE else "comm")
        return c[rank] if isinstance(c, dict) else c


@dataclass
class Simulation:
    table: ScheduleTable
    events: list[dict] = field(repr=False)
    """{'rank', 'kind', 'microbatch', 'chunk', 'start', 'end'}: F/B/W, send (the message in
    flight) and recv (the wait), like a RunResult's timeline."""
    problems: list[str]
    """Empty, or why the schedule cannot complete (deadlock, unmatched messages)."""
    makespan: float = 0.0
    busy: dict[int, float] = field(default_factory=dict)
    """Per rank: time spent in F/B/W."""
    per_rank: dict[int, float] = field(default_factory=dict)
    """Idle fraction of each rank between the first and last compute of the step: 1 - busy/makespan."""
    in_flight: dict[int, int] = field(default_factory=dict)
    """Per rank: most (microbatch, chunk) pairs whose activations were alive at once."""

    @property
    def deadlock(self) -> bool:
        return bool(self.problems)

    @property
    def bubble(self) -> float:
        """Mean idle fraction over ranks (RunResult.bubble_fraction's 'overall')."""
        return sum(self.per_rank.values()) / len(self.per_rank) if self.per_rank else 0.0

    def bubble_fraction(self) -> dict:
        return {"per_rank": dict(self.per_rank), "overall": self.bubble}


def simulate(table: ScheduleTable, costs: Costs | None = None, blocking_sends: bool = False) -> Simulation:
    costs = costs or Costs()
    p = table.p
    pos = [0] * p
    clock = [0.0] * p
    arrived: dict[tuple, float] = {}  # message -> arrival time (posted sends)
    parked: dict[tuple, tuple[int, float]] = {}  # rendezvous: message -> (sender, ready time)
    waiting: dict[tuple, int] = {}  # message -> rank blocked on it
    events: list[dict] = []
    alive = [0] * p
    peak = [0] * p
    split = any(a.op == "W" for acts in table.actions for a in acts)
    ready = deque(range(p))

    def emit(r, kind, a, start, end):
        events.append({"rank": r, "kind": kind, "microbatch": a.mb, "chunk": a.chunk, "start": start, "end": end})

    def deliver(key, t):
        arrived[key] = t
        if key in waiting:
            ready.append(waiting.pop(key))

    cost = [{op: costs.of(op, r) for op in ("F", "B", "W", "comm")} for r in range(p)]
    while ready:
        r = ready.popleft()
        acts = table.actions[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            t = clock[r]
            if a.op in COMPUTE:
                end = t + cost[r][a.op] * (costs.scale.get((r, a.chunk), 1.0) if costs.scale else 1.0)
                emit(r, a.op, a, t, end)
                clock[r] = end
                if a.op == "F":
                    alive[r] += 1
                    peak[r] = max(peak[r], alive[r])
                elif a.op == ("W" if split else "B"):
                    alive[r] -= 1
            elif a.op.startswith("send"):
                key = message(table, r, a)
                if not blocking_sends:
                    emit(r, "send", a, t, t + cost[r]["comm"])
                    deliver(key, t + cost[r]["comm"])
                elif key in waiting:  # the receiver is already there: meet
                    end = t + cost[r]["comm"]
                    emit(r, "send", a, t, end)
                    clock[r] = end
                    deliver(key, end)
                else:  # rendezvous: wait for the receiver
                    parked[key] = (r, t)
                    break
            else:
                key = message(table, r, a)
                if blocking_sends and key in parked:
                    sender, ts = parked.pop(key)
                    end = max(t, ts) + cost[sender]["comm"]
                    events.append(
                        {
                            "rank": sender,
                            "kind": "send",
                            "microbatch": a.mb,
                            "chunk": table.actions[sender][pos[sender]].chunk,
                            "start": ts,
                            "end": end,
                        }
                    )
                    clock[sender] = end
                    pos[sender] += 1
                    arrived[key] = end
                    ready.append(sender)
                if key not in arrived:
                    waiting[key] = r
                    break
                end = max(t, arrived.pop(key))
                emit(r, "recv", a, t, end)
                clock[r] = end
            pos[r] += 1

    problems = []
    for r in range(p):
        if pos[r] < len(table.actions[r]):
            problems.append(f"deadlock: rank {r} stuck at action {pos[r]} ({table.actions[r][pos[r]]})")
    if not problems and arrived:
        problems += [f"message {k} was sent but never received" for k in sorted(arrived)]
    return _finish(Simulation(table, events, problems), peak)


def _finish(sim: Simulation, peak: list[int]) -> Simulation:
    """Fill in the makespan, the busy time and idle fraction per rank, the peak in flight."""
    compute = [e for e in sim.events if e["kind"] in COMPUTE]
    if compute and not sim.problems:
        t0 = min(e["start"] for e in compute)
        t1 = max(e["end"] for e in compute)
        sim.makespan = t1 - t0
        busy = [0.0] * sim.table.p
        for e in compute:
            busy[e["rank"]] += e["end"] - e["start"]
        sim.busy = dict(enumerate(busy))
        sim.per_rank = {r: (1.0 - busy[r] / (t1 - t0)) if t1 > t0 else 0.0 for r in range(sim.table.p)}
        sim.in_flight = dict(enumerate(peak))
    return sim


def _nccl_partners(table: ScheduleTable, items) -> tuple[dict, list[str]]:
    """NCCL's matching: the k-th send from rank a to rank b meets the k-th receive on b from a,
    whatever the tags. Ops are (rank, slot index, index in the slot). Returns op -> partner op,
    and the problems: counts that differ, or a k-th pair that are different messages."""
    sends: dict[tuple[int, int], list] = {}  # (from, to) -> ops in posting order
    recvs: dict[tuple[int, int], list] = {}
    for r, its in enumerate(items):
        for i, it in enumerate(its):
            if isinstance(it, Action):
                continue
            for k, a in enumerate(it):
                side = sends if a.op.startswith("send") else recvs
                pair = (r, a.peer) if side is sends else (a.peer, r)
                side.setdefault(pair, []).append(((r, i, k), a))
    partner, problems = {}, []
    for pair in sorted(set(sends) | set(recvs)):
        out, got = sends.get(pair, []), recvs.get(pair, [])
        if len(out) != len(got):
            problems.append(f"rank {pair[0]} sends {len(out)} messages to rank {pair[1]}, which receives {len(got)}")
        for n, ((so, sa), (ro, ra)) in enumerate(zip(out, got)):
            if message(table, pair[0], sa) != message(table, pair[1], ra):
                problems.append(
                    f"NCCL ignores tags: rank {pair[0]}'s message {n} to rank {pair[1]} is {sa}, "
                    f"but rank {pair[1]}'s receive {n} from rank {pair[0]} is {ra}"
                )
            partner[so], partner[ro] = ro, so
    return partner, problems


def simulate_nccl(
    table: ScheduleTable, costs: Costs | None = None, issued: tuple[list, ...] | None = None
) -> Simulation:
    """The schedule as the executor issues it under NCCL (the module docstring's rules): each rank's
    items in order on one queue, a compute taking its cost, a batch of sends and receives (one
    group call) completing when all its ops have met their partners in the batches at the head
    of their peers' queues. issued: every rank's items (an Action, or a tuple of Actions posted
    together); default schedules.batches(table), what the executor issues."""
    costs = costs or Costs()
    p = table.p
    items = issued if issued is not None else batches(table)
    partner, problems = _nccl_partners(table, items)
    if problems:
        return Simulation(table, [], problems)
    cost = [{op: costs.of(op, r) for op in ("F", "B", "W", "comm")} for r in range(p)]
    split = any(a.op == "W" for acts in table.actions for a in acts)
    pos, clock, alive, peak = [0] * p, [0.0] * p, [0] * p, [0] * p
    posted: dict[tuple[int, int], float] = {}  # (rank, slot) -> when its batch was posted
    done: dict[tuple[int, int, int], float] = {}  # op -> when it met its partner
    events: list[dict] = []
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(items[r]):
                it, i = items[r][pos[r]], pos[r]
                if isinstance(it, Action):  # compute
                    end = clock[r] + cost[r][it.op]
                    events.append(_event(r, it.op, it, clock[r], end))
                    clock[r] = end
                    if it.op == "F":
                        alive[r] += 1
                        peak[r] = max(peak[r], alive[r])
                    elif it.op == ("W" if split else "B"):
                        alive[r] -= 1
                    pos[r] += 1
                    moved = True
                    continue
                posted.setdefault((r, i), clock[r])
                for k, a in enumerate(it):
                    q, j, kk = partner[(r, i, k)]
                    if (r, i, k) not in done and (q, j) in posted:  # both batches on the wire: they meet
                        sender = r if a.op.startswith("send") else q
                        done[(r, i, k)] = done[(q, j, kk)] = max(posted[(r, i)], posted[(q, j)]) + cost[sender]["comm"]
                if any((r, i, k) not in done for k in range(len(it))):
                    break
                for k, a in enumerate(it):
                    events.append(_event(r, a.op.split("_")[0], a, posted[(r, i)], done[(r, i, k)]))
                clock[r] = max(clock[r], *(done[(r, i, k)] for k in range(len(it))))
                pos[r] += 1
                moved = True
    for r in range(p):
        if pos[r] < len(items[r]):
            it = items[r][pos[r]]
            waits = [
                f"{a} (rank {partner[(r, pos[r], k)][0]} is at {_at(items, pos, partner[(r, pos[r], k)][0])})"
                for k, a in enumerate(it)
                if (r, pos[r], k) not in done
            ]
            problems.append(
                f"deadlock under NCCL: rank {r} stuck in batch [{', '.join(map(str, it))}]: " + "; ".join(waits)
            )
    return _finish(Simulation(table, events, problems), peak)


def _event(r: int, kind: str, a, start: float, end: float) -> dict:
    return {"rank": r, "kind": kind, "microbatch": a.mb, "chunk": a.chunk, "start": start, "end": end}


def _at(items, pos, q: int) -> str:
    if pos[q] >= len(items[q]):
        return "the end of its list"
    it = items[q][pos[q]]
    return str(it) if isinstance(it, Action) else "batch [" + ", ".join(map(str, it)) + "]"


def check(table: ScheduleTable) -> list[str]:
    """Every problem of a schedule: local ordering, unmatched messages and deadlock, under gloo's rules
    and under NCCL's (by simulation). Empty when the schedule is safe to run on either backend."""
    found = local_problems(table)
    if found:
        return found
    return simulate(table).problems or simulate_nccl(table).problems


class ScheduleDeadlock(RuntimeError):
    """A schedule that would hang (or is malformed); raised before any rank runs it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "pipeline schedule refused, it would not complete:\n" + "\n".join(f"  - {p}" for p in problems[:20])
        )
