"""What a run measured: RunResult with one RankReport per rank (plain data, JSON round-trip)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from labkit.config.choices import Data
from labkit.config.table import Rows, card
from labkit.layout.mesh import MeshLayout
from labkit.oracle.assembly import PieceIssue, assemble
from labkit.oracle.locate import Located, locate
from labkit.oracle.routes import place
from labkit.results.views import RankViews


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
    """Bytes this rank sends under the ring model (DERIVATIONS.md, "The ring model")."""
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
    threads: int = 0
    """The rank's intra-op threads (0: not reported): how its bf16 kernels split their work."""
    float8_matmuls: list[dict[str, int]] = field(default_factory=list)
    """precision='fp8': per step, the fp8 matmuls the rank ran, {'forward': n, 'backward': n}
    (engines/meters/float8.py); empty otherwise."""


def _event(d: dict, t0: float, offset: float) -> Event:
    known = {f.name for f in fields(Event)}
    extra = {k: v for k, v in d.items() if k not in known}
    return Event(
        kind=d["kind"],
        microbatch=d.get("microbatch"),
        chunk=d.get("chunk"),
        # onto rank 0's clock (offset: from the start-up handshake), from the run's first span (t0)
        start=d["start"] + offset - t0,
        end=d["end"] + offset - t0,
        step=d.get("step", 0),
        extra=extra.get("extra", extra),
    )


def rank_report(r: dict, t0: float, **more) -> RankReport:
    """A rank's report from its engine's plain data (a run's or a measurement's), its events moved
    onto the common clock that starts at t0; `more`: the fields only a run has."""
    return RankReport(
        rank=r["rank"],
        coords=r["coords"],
        host=r["host"],
        device=r["device"],
        memory=r["memory"],
        comm=[_comm(e, t0, r["clock_offset"]) for e in r["comm"]],
        timeline=[_event(e, t0, r["clock_offset"]) for e in r["timeline"]],
        **more,
    )


def _comm(d: dict, t0: float, offset: float) -> CommEvent:
    d = dict(d)
    d["start"] = d["start"] + offset - t0
    d["end"] = None if d["end"] is None else d["end"] + offset - t0
    return CommEvent(**d)


def _lists(tensors: dict) -> dict:
    """name -> array as flat lists under their shapes: JSON has no arrays."""
    return {k: {"shape": list(v.shape), "values": v.reshape(-1).tolist()} for k, v in tensors.items()}


def _arrays(lists: dict) -> dict:
    return {k: np.asarray(v["values"], dtype=np.float32).reshape(v["shape"]) for k, v in lists.items()}


def _assembled(reports: list[dict], pieces_of, what: str) -> tuple[dict | None, list[PieceIssue]]:
    """The full tensors of one kind of piece (pieces_of(report)), each piece tagged with its sender so
    that a copy that differs names its rank; (None, []) where no rank sent any."""
    mine = [{**pc, "rank": r["rank"]} for r in reports for pc in pieces_of(r) or []]
    return assemble(mine, what) if mine else (None, [])


VOCAB_TABLES = ("embed.tok.weight", "head.proj.weight")
"""The tensors whose rows are the vocabulary: the ones a padded vocabulary pads."""


def _split_padding(found: dict, vocab: int) -> dict | None:
    """Cut the padding rows (beyond `vocab`) off the vocabulary tables of each assembled kind in
    `found`, in place; returns them by kind ('params', 'grads', 'compute'), or None: no padding."""
    kinds = {"pieces": "params", "grad_pieces": "grads", "compute_pieces": "compute"}
    out: dict = {}
    for key, tensors in found.items():
        for name in VOCAB_TABLES:
            if tensors is not None and name in tensors and tensors[name].shape[0] > vocab:
                out.setdefault(kinds[key], {})[name] = tensors[name][vocab:]
                tensors[name] = tensors[name][:vocab]  # (V padded, h) -> (V, h): the reference's shape
    return out or None


@dataclass
class RunResult(RankViews):
    """What a run measured; its tables, bubble and trace are the views every result shares
    (labkit/results/views.py)."""

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
    """The first step's reduced gradients, before clipping (return_params=True): step_grads[0]."""
    step_grads: list[dict[str, np.ndarray]] | None = field(default=None, repr=False)
    """Every step's reduced gradients, before clipping (return_params=True): what the oracle's
    reference replays (labkit/oracle/replay.py), and holds tensor by tensor at every step."""
    routes: dict[int, np.ndarray] | None = field(default=None, repr=False)
    """MoE runs with return_params: the experts each token went to, {layer: (steps, B, S, k)}
    (labkit/oracle/routes.py), which the reference follows where the two arithmetics tie."""
    compute: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """The final weights forward reads, where they are not the masters (return_params=True;
    GradSync.compute_pieces)."""
    piece_issues: list[PieceIssue] = field(default_factory=list, repr=False)
    """What assembling found: copies of one element that differ between ranks, non-finite values."""
    data: Data = "synthetic"
    """What the run trained on: 'synthetic' or 'text' (labkit/layout/text.py)."""
    validation_loss: float | None = None
    """data='text': the trained model's mean loss on the held-out validation windows, computed by
    the ranks in the run's own layout after the last step (engines/evaluate.py); else None."""
    padding: dict[str, dict[str, np.ndarray]] | None = field(default=None, repr=False)
    """A padded vocabulary's padding rows (ModelConfig.vocab_divisible_by), kept apart: what -> name ->
    rows [vocab:) of 'params', 'grads', 'compute'. params / grads / compute hold the vocabulary rows
    alone, the unpadded model the reference trains; the oracle holds these at zero (checks.padding)."""
    buffers: dict[str, np.ndarray] | None = field(default=None, repr=False)
    """Final buffers training changes (the MoE routers' aux-loss-free biases), assembled like params
    (return_params=True): every rank's copy must agree, and the oracle compares them (checks.buffers)."""
    activations: list[dict] | None = field(default=None, repr=False)
    """locate=True: per rank, {"rank", "coords", "records", "order", "bytes"}: its first step's module outputs
    and their gradients (engines/locate.py), which labkit/oracle/locate.py puts together and locates."""

    # -- assembling from the engines' plain data ----------------------------------------------
    @classmethod
    def from_reports(
        cls, cfg, model, optim, steps, seed, reports: list[dict], wall: float, data: Data = "synthetic"
    ) -> RunResult:
        # ranks outside the layout (a world larger than it) took part in nothing
        active = [r for r in reports if not r.get("idle")]
        starts = [e["start"] + r["clock_offset"] for r in active for e in r["timeline"]]
        t0 = min(starts) if starts else 0.0
        ranks = [
            rank_report(
                r,
                t0,
                losses=r["losses"],
                grad_norms=r.get("grad_norms", []),
                step_times=r.get("step_times", []),
                info=r.get("info", {}),
                threads=r.get("threads", 0),
                float8_matmuls=r.get("float8_matmuls", []),
            )
            for r in active
        ]
        shards = cfg.dp * cfg.ep * cfg.cp
        # every tp rank computes the same loss (counted on tp 0 alone); the pipeline's shares are summed and
        # the data shards' averaged
        losses = [sum(rk.losses[s] for rk in ranks if rk.coords["tp"] == 0) / shards for s in range(steps)]
        found: dict[str, dict | None] = {}
        issues: list[PieceIssue] = []
        for key, what in (
            ("pieces", "parameters"),
            ("compute_pieces", "working weights"),
            ("buffer_pieces", "buffers"),
        ):
            found[key], more = _assembled(active, lambda r, key=key: r.get(key), what)
            issues += more
        step_grads = []
        for s in range(max((len(r.get("grad_pieces") or []) for r in active), default=0)):
            grads, more = _assembled(active, lambda r, s=s: (r.get("grad_pieces") or [None] * (s + 1))[s], "gradients")
            step_grads.append(grads)
            issues += [replace(i, what=f"step {s}'s gradients") if s else i for i in more]
        found["grad_pieces"] = step_grads[0] if step_grads else None
        padding = _split_padding(found, model.vocab) or {}
        for s, grads in enumerate(step_grads[1:], 1):  # the later steps' padding rows, held at zero the same way
            for name, rows in (_split_padding({"grad_pieces": grads}, model.vocab) or {}).get("grads", {}).items():
                padding.setdefault(f"grads (step {s})", {})[name] = rows
        routes, more = place(active, cfg, model.seq, steps)
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
            step_grads=step_grads or None,
            routes=routes,
            compute=found["compute_pieces"],
            piece_issues=issues,
            data=data,
            validation_loss=validation,
            padding=padding or None,
            buffers=found["buffer_pieces"],
            activations=[{"rank": r["rank"], "coords": r["coords"], **r["activations"]} for r in active]
            if any("activations" in r for r in active)
            else None,
        )

    def generate(self, prompt: str, tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
        """`tokens` bytes that continue `prompt`, sampled from the run's final parameters in this
        process (engines/generate.py: temperature 0 is greedy; the same seed, the same text).
        Needs the parameters: a run on data='text' brings them back, any other with return_params."""
        if self.params is None:
            raise ConfigError(["the run did not bring back its parameters; run with data='text' or return_params=True"])
        from labkit.engines.generate import generate  # torch: loaded when sampling, not with the results

        return generate(self.model, self.params, prompt, tokens, temperature, seed)

    def located(self, ref) -> Located | None:
        """Where this run (locate=True) first left `ref`'s one-process training: `str()` of it is the
        sentence ("block 0, attn.wo forward output, tp ranks 0-1, ...: 0.73 over a bound of 1e-05; its
        inputs matched", or the phase outside every module); None where nothing is wrong (labkit/oracle/
        locate.py)."""
        return locate(self, ref)

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
        for key in ("params", "grads", "compute", "buffers"):
            if getattr(self, key) is not None:
                d[key] = _lists(getattr(self, key))
        if self.padding:
            d["padding"] = {kind: _lists(t) for kind, t in self.padding.items()}
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
        tensors = {key: _arrays(d[key]) if d.get(key) else None for key in ("params", "grads", "compute", "buffers")}
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
            padding={kind: _arrays(t) for kind, t in d["padding"].items()} if d.get("padding") else None,
            buffers=tensors["buffers"],
        )

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def load(cls, path) -> RunResult:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # -- what a notebook shows ------------------------------------------------------------------
    def compare(self, ref) -> Rows:
        """The losses step by step beside a reference's (labkit.oracle.reference), with the relative
        error; the result's card shows them from then on."""
        # kept on the result, so that its card shows the comparison from then on
        self._reference_losses = list(ref.losses)
        return self.loss_table()

    def loss_table(self) -> Rows:
        """Rows {step, loss} per step (and reference, relative_error once `compare` was called)."""
        ref = getattr(self, "_reference_losses", None)
        rows = Rows({"step": s + 1, "loss": loss} for s, loss in enumerate(self.losses))
        if ref is not None:
            for row, r in zip(rows, ref):
                row.update(reference=r, relative_error=abs(row["loss"] - r) / abs(r))
        return rows

    def _repr_html_(self) -> str:
        cfg = self.config
        facts = [
            (
                "layout",
                f"{MeshLayout.of(cfg).describe()} ({cfg.order}), sharding={cfg.sharding}, impl={cfg.impl}, "
                f"{cfg.precision}, microbatches={cfg.microbatches}",
            ),
            ("run", f"{self.steps} steps in {self.wall_seconds:.2f} s on {len(self.ranks)} ranks"),
        ]
        more, tables = self._glance()
        tables.insert(
            0, ("losses" + (" vs the reference" if hasattr(self, "_reference_losses") else ""), self.loss_table())
        )
        return card("RunResult", facts + more, tables)
