"""What a run measured: RunResult with one RankReport per rank (plain data, JSON round-trip)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from labkit.assembly import PieceIssue, assemble
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig

COMPUTE_KINDS = ("F", "B", "W")


@dataclass
class CommEvent:
    """One collective or point-to-point op on one rank."""

    op: str
    """all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | reduce | send | recv | barrier"""
    dim: str
    """Mesh dimension of its group: 'dp', 'tp', ..., a combination such as 'dp-cp', or 'world'."""
    group: list[int]
    """Global ranks of the group."""
    numel: int
    dtype: str
    payload_bytes: int
    """B: bytes of the logical full tensor (the all-reduced tensor, the gathered output, ...)."""
    wire_bytes: float
    """Bytes this rank sends under the ring model (ARCHITECTURE.md)."""
    start: float
    end: float | None
    """Seconds on the run's clock; None if the op never completed (a hang)."""
    phase: str
    """forward | backward | optimizer | ... : the part of the step that issued it."""
    step: int = 0
    seq: int = 0
    """Sequence number of this op within its group on this rank (hang diagnosis)."""
    peer: int | None = None
    shape: list[int] = field(default_factory=list)


@dataclass
class Event:
    """One span on a rank's timeline."""

    kind: str
    """'F', 'B', 'W' (compute of a microbatch), 'send', 'recv', 'sync', 'opt', 'step', ..."""
    microbatch: int | None
    chunk: int | None
    start: float
    end: float
    step: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class RankReport:
    rank: int
    coords: dict[str, int]
    host: str
    device: str
    memory: dict[str, int]
    """Bytes: params, grads, optimizer, activations (peak of saved-for-backward), peak."""
    comm: list[CommEvent]
    timeline: list[Event]
    losses: list[float]
    """This rank's share of the loss per step (see RunResult.losses)."""
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    info: dict = field(default_factory=dict)


def _event(d: dict, t0: float, offset: float) -> Event:
    known = {f.name for f in fields(Event)}
    extra = {k: v for k, v in d.items() if k not in known}
    return Event(
        kind=d["kind"],
        microbatch=d.get("microbatch"),
        chunk=d.get("chunk"),
        start=d["start"] + offset - t0,
        end=d["end"] + offset - t0,
        step=d.get("step", 0),
        extra=extra.get("extra", extra),
    )


def _comm(d: dict, t0: float, offset: float) -> CommEvent:
    d = dict(d)
    d["start"] = d["start"] + offset - t0
    d["end"] = None if d["end"] is None else d["end"] + offset - t0
    return CommEvent(**d)


@dataclass
class RunResult:
    config: ParallelConfig
    model: ModelConfig
    steps: int
    seed: int
    losses: list[float]
    """Global mean loss per step: the mean over all data shards (dp x ep x cp) of the ranks'
    local losses, tp duplicates dropped, pipeline stages summed."""
    ranks: list[RankReport]
    optim: OptimConfig = field(default_factory=OptimConfig)
    wall_seconds: float = 0.0
    params: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """Final full parameters (the fp32 masters), assembled from every rank's pieces (return_params=True,
    or data='text')."""
    audit: list[dict] | None = field(default=None, repr=False)
    grads: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """The first step's reduced gradients, before clipping (return_params=True)."""
    compute: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """The final weights forward reads, where they are not the masters (return_params=True;
    GradSync.compute_pieces)."""
    piece_issues: list[PieceIssue] = field(default_factory=list, repr=False)
    """What assembling found: copies of one element that differ between ranks, non-finite values."""
    data: str = "synthetic"
    """What the run trained on: 'synthetic' or 'text' (labkit/plans/text.py)."""
    validation_loss: float | None = None
    """data='text': the trained model's mean loss on the held-out validation windows, computed by
    the ranks in the run's own layout after the last step (engines/evaluate.py); else None."""

    # -- assembling from the engines' plain data ----------------------------------------------
    @classmethod
    def from_reports(
        cls, cfg, model, optim, steps, seed, reports: list[dict], wall: float, data: str = "synthetic"
    ) -> RunResult:
        active = [r for r in reports if not r.get("idle")]
        starts = [e["start"] + r["clock_offset"] for r in active for e in r["timeline"]]
        t0 = min(starts) if starts else 0.0
        ranks = [
            RankReport(
                rank=r["rank"],
                coords=r["coords"],
                host=r["host"],
                device=r["device"],
                memory=r["memory"],
                comm=[_comm(e, t0, r["clock_offset"]) for e in r["comm"]],
                timeline=[_event(e, t0, r["clock_offset"]) for e in r["timeline"]],
                losses=r["losses"],
                grad_norms=r.get("grad_norms", []),
                step_times=r.get("step_times", []),
                info=r.get("info", {}),
            )
            for r in active
        ]
        shards = cfg.dp * cfg.ep * cfg.cp
        losses = [sum(rk.losses[s] for rk in ranks if rk.coords["tp"] == 0) / shards for s in range(steps)]
        found: dict[str, dict | None] = {}
        issues: list[PieceIssue] = []
        for key, what in (
            ("pieces", "parameters"),
            ("grad_pieces", "gradients"),
            ("compute_pieces", "working weights"),
        ):
            mine = [{**pc, "rank": r["rank"]} for r in active for pc in r.get(key) or []]
            found[key], more = assemble(mine, what) if mine else (None, [])
            issues += more
        audit = [r["audit"] for r in active] if any("audit" in r for r in active) else None
        validation = None
        if any("validation" in r for r in active):  # shares add up like the losses above
            validation = sum(r["validation"] for r in active if r["coords"]["tp"] == 0) / shards
        return cls(
            cfg,
            model,
            steps,
            seed,
            losses,
            ranks,
            optim,
            wall,
            found["pieces"],
            audit,
            grads=found["grad_pieces"],
            compute=found["compute_pieces"],
            piece_issues=issues,
            data=data,
            validation_loss=validation,
        )

    def generate(self, prompt: str, tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
        """`tokens` bytes that continue `prompt`, sampled from the run's final parameters in this
        process (engines/generate.py: temperature 0 is greedy; the same seed, the same text).
        Needs the parameters: a run on data='text' brings them back, any other with return_params."""
        if self.params is None:
            raise ConfigError(["the run did not bring back its parameters; run with data='text' or return_params=True"])
        from labkit.engines.generate import generate  # torch: loaded when sampling, not with the results

        return generate(self.model, self.params, prompt, tokens, temperature, seed)

    # -- views ------------------------------------------------------------------------------
    def comm_table(self, step: int | None = -1) -> list[dict]:
        """Rows {rank, dim, op, calls, payload_bytes, wire_bytes} per rank x dim x op, for one
        step (default: the last — the steady state) or summed over all steps (step=None)."""
        wanted = None if step is None else (step % self.steps)
        acc: dict[tuple, dict] = {}
        for rk in self.ranks:
            for e in rk.comm:
                if wanted is not None and e.step != wanted:
                    continue
                row = acc.setdefault(
                    (rk.rank, e.dim, e.op),
                    {"rank": rk.rank, "dim": e.dim, "op": e.op, "calls": 0, "payload_bytes": 0, "wire_bytes": 0.0},
                )
                row["calls"] += 1
                row["payload_bytes"] += e.payload_bytes
                row["wire_bytes"] += e.wire_bytes
        return [acc[k] for k in sorted(acc)]

    def bubble_fraction(self, step: int = -1) -> dict:
        """Idle fraction of each rank between the first and last compute span (F/B/W) of its
        pipeline in the step: {'per_rank': {rank: f}, 'overall': mean}. 0 without a pipeline.

        This is what (p-1)/(m+p-1) means: the pipeline's step lasts (m+p-1)(t_F+t_B) from the
        first stage's first forward to its last backward, and each stage computes m(t_F+t_B) of
        it. The window is taken per pipeline (ranks that differ only in pp), since data-parallel
        replicas run their pipelines independently until the gradient reduction; time in
        send/recv counts as idle, as in the formula (which assumes free communication)."""
        wanted = step % self.steps
        spans = {rk.rank: [e for e in rk.timeline if e.kind in COMPUTE_KINDS and e.step == wanted] for rk in self.ranks}
        per = {r: 0.0 for r in spans}
        if self.config.pp > 1:
            pipelines: dict[tuple, list[int]] = defaultdict(list)
            for rk in self.ranks:
                pipelines[tuple(v for d, v in sorted(rk.coords.items()) if d != "pp")].append(rk.rank)
            for ranks in pipelines.values():
                everything = [e for r in ranks for e in spans[r]]
                if not everything:
                    continue
                t0 = min(e.start for e in everything)
                t1 = max(e.end for e in everything)
                for r in ranks:
                    per[r] = 1.0 - sum(e.end - e.start for e in spans[r]) / (t1 - t0)
        return {"per_rank": per, "overall": float(np.mean(list(per.values()))) if per else 0.0}

    def memory_table(self) -> list[dict]:
        return [{"rank": rk.rank, **rk.memory} for rk in self.ranks]

    # -- persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "config": self.config.to_dict(),
            "model": self.model.to_dict(),
            "optim": self.optim.to_dict(),
            "steps": self.steps,
            "seed": self.seed,
            "losses": self.losses,
            "wall_seconds": self.wall_seconds,
            "data": self.data,
            "validation_loss": self.validation_loss,
            "ranks": [asdict(r) for r in self.ranks],
        }
        for key in ("params", "grads", "compute"):
            if getattr(self, key) is not None:
                d[key] = {
                    k: {"shape": list(v.shape), "values": v.reshape(-1).tolist()} for k, v in getattr(self, key).items()
                }
        d["piece_issues"] = [i.to_dict() for i in self.piece_issues]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunResult:
        ranks = []
        for r in d["ranks"]:
            r = dict(r)
            r["comm"] = [CommEvent(**e) for e in r["comm"]]
            r["timeline"] = [Event(**e) for e in r["timeline"]]
            ranks.append(RankReport(**r))
        tensors = {
            key: {k: np.asarray(v["values"], dtype=np.float32).reshape(v["shape"]) for k, v in d[key].items()}
            if d.get(key)
            else None
            for key in ("params", "grads", "compute")
        }
        return cls(
            ParallelConfig.from_dict(d["config"]),
            ModelConfig.from_dict(d["model"]),
            d["steps"],
            d["seed"],
            d["losses"],
            ranks,
            OptimConfig.from_dict(d["optim"]),
            d.get("wall_seconds", 0.0),
            tensors["params"],
            grads=tensors["grads"],
            compute=tensors["compute"],
            piece_issues=[PieceIssue.from_dict(i) for i in d.get("piece_issues", [])],
            data=d.get("data", "synthetic"),
            validation_loss=d.get("validation_loss"),
        )

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path) -> RunResult:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def trace(self) -> dict:
        """Chrome / Perfetto trace (chrome://tracing, ui.perfetto.dev): one process per rank,
        compute and step spans on one track, communication on another."""
        events = []
        for rk in self.ranks:
            pid = rk.rank
            events.append(
                {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"rank {rk.rank} {rk.coords}"}}
            )
            events.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
            events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name", "args": {"name": "comm"}})
            for e in rk.timeline:
                label = e.kind if e.microbatch is None else f"{e.kind}{e.microbatch}"
                events.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 0,
                        "name": label,
                        "ts": e.start * 1e6,
                        "dur": (e.end - e.start) * 1e6,
                        "args": {"microbatch": e.microbatch, "chunk": e.chunk, "step": e.step},
                    }
                )
            for c in rk.comm:
                end = c.end if c.end is not None else c.start
                events.append(
                    {
                        "ph": "X",
                        "pid": pid,
                        "tid": 1,
                        "name": f"{c.op}[{c.dim}]",
                        "ts": c.start * 1e6,
                        "dur": (end - c.start) * 1e6,
                        "args": {
                            "group": c.group,
                            "numel": c.numel,
                            "dtype": c.dtype,
                            "wire_bytes": c.wire_bytes,
                            "phase": c.phase,
                            "seq": c.seq,
                        },
                    }
                )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_trace(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.trace(), f)
