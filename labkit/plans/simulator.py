"""Run a pipeline plan on paper: the ideal timeline, the bubble, the activations in flight, and
whether it would deadlock. Pure Python, no processes; fast enough for p = 64, m = 256.

Each rank executes its list in order, one action at a time. A compute action (F/B/W) takes its
cost; a send is posted and the rank goes on (the executor's isend), the message arriving
`comm` later; a receive waits until its message has arrived. So every action starts at
max(end of the rank's previous action, arrival of what it receives) — a dataflow that has one
answer whatever order the ranks are stepped in. With `blocking_sends=True` a send instead waits
until the peer reaches the matching receive (a rendezvous, as a blocking gloo/NCCL send of a
large tensor): the naive 1F1B list then deadlocks, which is why the executor posts its sends
asynchronously. When no rank can move and some have actions left, the plan would hang: the
result lists what each stuck rank waits for, and nothing is run. `check` is what the executor
asks before it runs a plan: the plan's local mistakes (schedules.local_problems), then this.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from labkit.plans.schedules import COMPUTE, Plan, local_problems, stage_of


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
    cost in proportion to their layers (theory/pipeline.py `stage_scale`)."""

    def of(self, op: str, rank: int) -> float:
        c = getattr(self, op if op in COMPUTE else "comm")
        return c[rank] if isinstance(c, dict) else c


@dataclass
class Simulation:
    plan: Plan
    events: list[dict] = field(repr=False)
    """{'rank', 'kind', 'microbatch', 'chunk', 'start', 'end'}: F/B/W, send (the message in
    flight) and recv (the wait), like a RunResult's timeline."""
    problems: list[str]
    """Empty, or why the plan cannot complete (deadlock, unmatched messages)."""
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


def _key(pl: Plan, rank: int, a) -> tuple:
    """Which message an action sends or receives: (kind, microbatch, receiving virtual stage)."""
    s = stage_of(rank, a.chunk, pl.p)
    if a.op == "send_act":
        return ("act", a.mb, s + 1)
    if a.op == "recv_act":
        return ("act", a.mb, s)
    if a.op == "send_grad":
        return ("grad", a.mb, s - 1)
    return ("grad", a.mb, s)  # recv_grad


def simulate(pl: Plan, costs: Costs | None = None, blocking_sends: bool = False) -> Simulation:
    costs = costs or Costs()
    p = pl.p
    pos = [0] * p
    clock = [0.0] * p
    arrived: dict[tuple, float] = {}  # message -> arrival time (posted sends)
    parked: dict[tuple, tuple[int, float]] = {}  # rendezvous: message -> (sender, ready time)
    waiting: dict[tuple, int] = {}  # message -> rank blocked on it
    events: list[dict] = []
    alive = [0] * p
    peak = [0] * p
    split = any(a.op == "W" for acts in pl.actions for a in acts)
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
        acts = pl.actions[r]
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
                key = _key(pl, r, a)
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
                key = _key(pl, r, a)
                if blocking_sends and key in parked:
                    sender, ts = parked.pop(key)
                    end = max(t, ts) + cost[sender]["comm"]
                    events.append(
                        {
                            "rank": sender,
                            "kind": "send",
                            "microbatch": a.mb,
                            "chunk": pl.actions[sender][pos[sender]].chunk,
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
        if pos[r] < len(pl.actions[r]):
            problems.append(f"deadlock: rank {r} stuck at action {pos[r]} ({pl.actions[r][pos[r]]})")
    if not problems and arrived:
        problems += [f"message {k} was sent but never received" for k in sorted(arrived)]
    sim = Simulation(pl, events, problems)
    compute = [e for e in events if e["kind"] in COMPUTE]
    if compute and not problems:
        t0 = min(e["start"] for e in compute)
        t1 = max(e["end"] for e in compute)
        sim.makespan = t1 - t0
        busy = [0.0] * p
        for e in compute:
            busy[e["rank"]] += e["end"] - e["start"]
        sim.busy = dict(enumerate(busy))
        sim.per_rank = {r: (1.0 - busy[r] / (t1 - t0)) if t1 > t0 else 0.0 for r in range(p)}
        sim.in_flight = dict(enumerate(peak))
    return sim


def check(pl: Plan) -> list[str]:
    """Every problem of a plan: local ordering, unmatched messages and deadlock (by simulation).
    Empty when the plan is safe to run."""
    found = local_problems(pl)
    if found:
        return found
    return simulate(pl).problems


class ScheduleDeadlock(RuntimeError):
    """A plan that would hang (or is malformed); raised before any rank runs it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "pipeline schedule refused, it would not complete:\n" + "\n".join(f"  - {p}" for p in problems[:20])
        )
