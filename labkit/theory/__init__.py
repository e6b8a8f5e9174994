"""Theory: what a layout costs, predicted without running it (pure Python + numpy, no torch).

    est = theory.estimate(ParallelConfig(dp=4), ModelConfig())
    est.memory[r]        # bytes per category on rank r, like RunResult.ranks[r].memory
    est.comm_table()     # rows like RunResult.comm_table(): per rank x dim x op, one step
    est.bubble_fraction()

    theory.evaluate(cfg, model, hardware="h100")      # Plan: what one GPU holds, term by term, and the step's time
    theory.plan(model, gpus=256, global_batch=512)     # the best layouts that fit, fastest first

For labkit's own implementations the predicted wire bytes and model-state bytes equal the
measured ones exactly, and activations match the saved-tensor meter; tests hold it to that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from labkit.config.table import Rows, card, human_bytes
from labkit.config.validation import argument_problems, problems
from labkit.layout.mesh import DATA_DIMS, MeshLayout
from labkit.theory.exact.comm import Stopped
from labkit.theory.exact.context import window_exchanged
from labkit.theory.exact.memory import (
    activation_bytes,
    korthikanti_layer_bytes,
    model_state_bytes,
)
from labkit.theory.exact.model import active_params, num_params, param_shapes
from labkit.theory.exact.per_rank import rank_comm, rank_memory
from labkit.theory.exact.pipeline import bubble_fraction as pipeline_bubble
from labkit.theory.exact.pipeline import step_bubble
from labkit.theory.planner.evaluate import Plan, evaluate
from labkit.theory.planner.hardware import HARDWARE, Hardware
from labkit.theory.planner.search import Plans, plan
from labkit.theory.planner.timing import H100, StepTime, step_time


@dataclass
class Estimate:
    config: ParallelConfig
    model: ModelConfig
    world: int
    memory: list[dict]
    """Per rank: bytes of params, grads, optimizer, activations (peak) and peak. Ranks of one
    class (same pipeline stage and shard) share one dict."""
    rows_of: dict[int, list[dict]] = field(repr=False)
    """Comm rows of each class's representative rank (see `rank_rows`)."""
    representative: list[int] = field(repr=False)
    """representative[r]: the rank whose rows rank r shares (ranks differ only in symmetric dims)."""
    bubble: float = 0.0
    laid_out: ModelConfig | None = field(default=None, repr=False)
    """The model as the ranks hold it: `model` with a padded vocabulary's padding rows counted as
    vocabulary (ModelConfig.padded); what every prediction here prices. None: `model` itself."""

    @property
    def padding_params(self) -> int:
        """Parameters the vocabulary's padding adds (embedding and untied head), beside the published Ψ."""
        return num_params(self.laid_out or self.model) - num_params(self.model)

    def rank_rows(self, rank: int) -> list[dict]:
        """One rank's rows {rank, dim, op, calls, payload_bytes, wire_bytes} for one step."""
        # the class's rows under this rank's number: the bytes are its representative's
        return [{**row, "rank": rank} for row in self.rows_of[self.representative[rank]]]

    def comm_table(self) -> Rows:
        """Every rank's rows, in rank order (like RunResult.comm_table()); built on demand —
        at thousands of ranks prefer rank_rows(r)."""
        return Rows(row for r in range(len(self.representative)) for row in self.rank_rows(r))

    def memory_table(self) -> Rows:
        """One row per rank: predicted bytes of each memory category (like RunResult.memory_table())."""
        return Rows({"rank": r, **m} for r, m in enumerate(self.memory))

    def fullest(self) -> int:
        """The rank with the highest predicted peak."""
        return max(range(len(self.memory)), key=lambda r: self.memory[r]["peak"])

    def _repr_html_(self) -> str:
        cfg, r = self.config, self.fullest()
        per_dim = Rows(
            {**row, "sent": human_bytes(row["wire_bytes"])}
            for row in sorted(self.rank_rows(r), key=lambda row: (row["dim"], row["op"]))
        )
        facts = [
            (
                "layout",
                f"{MeshLayout.of(cfg).describe()} ({cfg.order}) on {self.world:,} ranks, "
                f"sharding={cfg.sharding}, impl={cfg.impl}, {cfg.precision}, microbatches={cfg.microbatches}",
            ),
            ("model", f"Ψ = {num_params(self.model):,} parameters" + self._padding()),
            (f"fullest rank ({r})", ", ".join(f"{k} {human_bytes(v)}" for k, v in self.memory[r].items())),
            ("bubble", f"{self.bubble:.1%}"),
        ]
        return card("Estimate (theory)", facts, [(f"communication of rank {r}, one step (ring model)", per_dim)])

    def _padding(self) -> str:
        laid = self.laid_out or self.model
        if laid.vocab == self.model.vocab:
            return ""
        return f", + {self.padding_params:,} of vocabulary padding ({self.model.vocab:,} -> {laid.vocab:,} rows)"

    @property
    def comm(self) -> list[dict]:
        return self.comm_table()

    def bubble_fraction(self) -> dict:
        return {"per_rank": {r: self.bubble for r in range(len(self.representative))}, "overall": self.bubble}

    def step_time(self, hw: Hardware | None = None, rank: int = 0) -> StepTime:
        """The time model (theory/planner/timing.py) for one step of this layout on `hw` (default the
        H100): compute op by op on a roofline, each dim's collectives by α-β on the link its
        groups span, what overlaps hidden, the bubble; `.dominant` names what dominates. The
        step is the slowest pipeline rank's, whichever `rank` is asked for."""
        return step_time(self.config, self.laid_out or self.model, hw or H100, self.world)


def _classes(cfg: ParallelConfig, layout: MeshLayout) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: its pipeline stage, and its index in its data-parallel (dp x ep x cp) group —
    the only coordinates the predictions depend on (tp, cp and ep ranks are symmetric; the
    shard index decides how many of an FSDP2 parameter's dim-0 rows a rank holds)."""
    # every rank's coordinate along each axis of the grid, all ranks at once (no loop over 16k ranks)
    idx = np.unravel_index(np.arange(layout.world), layout.grid.shape)
    coord = {d: idx[layout._axis(d)] for d in layout.inner_first}
    shard, stride = np.zeros(layout.world, dtype=np.int64), 1
    for d in layout.canonical(DATA_DIMS):  # sorted group ranks: inner dims vary fastest
        shard += coord[d] * stride
        stride *= layout.size(d)
    return coord["pp"], shard


def _window_class(cfg: ParallelConfig, model: ModelConfig, layout: MeshLayout) -> np.ndarray:
    """Per rank: its cp coordinate where its comm rows depend on it — sliding-window layers under a cp
    kind that exchanges the window's rows (labkit/layout/window.py: each rank its own tails) — else 0."""
    if not window_exchanged(cfg, model):
        return np.zeros(layout.world, dtype=np.int64)
    idx = np.unravel_index(np.arange(layout.world), layout.grid.shape)
    return idx[layout._axis("cp")]


def estimate(
    cfg: ParallelConfig, model: ModelConfig | None = None, world: int | None = None, optim: OptimConfig | None = None
) -> Estimate:
    """Predicted memory, communication and bubble of `cfg` on `model` (trained by `optim`: AdamW by default;
    Muon's state and gathers: theory/exact/muon.py).

    world: the number of ranks (default: the layout's product); extra ranks are idle. Only the
    layout's arithmetic is checked (not whether the engines implement it yet), so any layout
    at any scale can be estimated. Ranks that differ only in dims the theory treats as
    symmetric share one computation, so 16,384 ranks cost about what one pipeline's do.
    """
    model = model or ModelConfig()
    if not (isinstance(cfg, ParallelConfig) and isinstance(model, ModelConfig)):
        raise ConfigError(argument_problems("estimate", cfg, model))
    found = problems(cfg, model, world)
    if found:
        raise ConfigError(found)
    given, model = model, model.padded(cfg.tp)  # a padded vocabulary's rows priced as the ranks hold them
    layout = MeshLayout.of(cfg)
    stage, shard = _classes(cfg, layout)
    # only FSDP2's uneven dim-0 chunks differ by shard index, and Distributed Muon's state: a slice holds
    # its own share of Muon's matrices (theory/exact/sharding.py state_bytes)
    muon_sharded = optim is not None and optim.kind.muon and cfg.sharded.optimizer
    if not (cfg.sharded.fsdp and cfg.torch_impl) and not muon_sharded:
        shard = np.zeros_like(shard)
    # one rank_memory per (stage, shard) class; every rank of the class shares its dict
    keys = list(zip(stage.tolist(), shard.tolist(), _window_class(cfg, model, layout).tolist()))
    first: dict[tuple, int] = {}
    for r, k in enumerate(keys):
        first.setdefault(k, r)
    by_key = {k: rank_memory(cfg, model, layout, r, optim) for k, r in first.items()}
    memory = [by_key[k] for k in keys]

    # the comm rows depend on the stage alone (the splits are even): one rank per stage is walked;
    # with sliding-window layers under cp on the cp coordinate too (each rank's window rows differ)
    cls = list(zip(stage.tolist(), _window_class(cfg, model, layout).tolist()))
    stage_rep: dict[tuple, int] = {}
    for r, s in enumerate(cls):
        stage_rep.setdefault(s, r)
    representative = [stage_rep[s] for s in cls]
    rows_of = rank_comm(cfg, model, layout, stage_rep.values(), optim=optim)
    return Estimate(
        cfg,
        given,
        world or layout.world,
        memory,
        rows_of,
        representative,
        step_bubble(cfg, model),
        laid_out=model,
    )


__all__ = [
    "estimate",
    "Estimate",
    "evaluate",
    "plan",
    "Plan",
    "Plans",
    "HARDWARE",
    "model_state_bytes",
    "activation_bytes",
    "korthikanti_layer_bytes",
    "num_params",
    "active_params",
    "param_shapes",
    "pipeline_bubble",
    "rank_memory",
    "rank_comm",
    "Stopped",
]
