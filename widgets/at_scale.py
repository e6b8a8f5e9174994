"""The ScaleExplorer's view model: the theory's prediction for one layout on one rank per shown
pipeline stage (memory, model states, bubble, communication) and the planner's Plan of the same
layout (what one GPU holds, term by term, and the step's time), without a per-rank loop over the
world. Why not theory.estimate: see widgets/scale.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from labkit import theory
from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.mesh import MeshLayout

STAGES_SHOWN = 16
"""At most this many pipeline stages get a bar (first and last always among them)."""


@dataclass
class AtScale:
    """The theory's prediction for one layout, on one rank per (shown) pipeline stage."""

    config: ParallelConfig
    model: ModelConfig
    psi: int
    stages: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    comm: list[list[dict]] = field(default_factory=list)
    comm_pending: bool = False
    bubble: float = 0.0
    states: dict = field(default_factory=dict)
    plan: theory.Plan | None = None
    """The planner's price of this layout (theory.evaluate): what the fullest GPU holds, term by
    term, and the step's time on the chosen hardware."""

    @property
    def peak(self) -> float:
        return max((m.get("peak", 0) for m in self.memory), default=0)


def shown_stages(pp: int) -> list[int]:
    if pp <= STAGES_SHOWN:
        return list(range(pp))
    # evenly spread, the first and the last included: they hold the embedding and the head
    return sorted({int(round(x)) for x in np.linspace(0, pp - 1, STAGES_SHOWN)})


def at_scale(cfg: ParallelConfig, model: ModelConfig, comm: bool = True, hardware: str = "h100") -> AtScale:
    """Memory, states and bubble of `cfg` (comm rows too unless comm=False) and its Plan on
    `hardware`; no per-rank loop of ours over the world. Call `comm_at_scale` for the comm rows
    on their own."""
    layout = MeshLayout.of(cfg)
    stages = shown_stages(cfg.pp)
    # one rank per stage, its other coordinates 0: ranks that differ only in dp/tp/cp/ep are alike
    # in every strategy's theory (the module docstring of widgets/scale.py)
    ranks = [layout.rank(pp=s) for s in stages]
    psi = theory.num_params(model)
    view = AtScale(
        cfg,
        model,
        psi,
        stages,
        ranks,
        memory=[theory.rank_memory(cfg, model, layout, r) for r in ranks],
        bubble=theory.pipeline_bubble(cfg.pp, cfg.microbatches, cfg.virtual_stages),
        states=theory.model_state_bytes(psi, cfg.dp, cfg.precision),
        plan=theory.evaluate(cfg, model, hardware=hardware),
    )
    if comm:
        view.comm = comm_at_scale(cfg, model)
    else:
        # an empty row per rank until the thread fills them: the comm figure says "computing…" meanwhile
        view.comm, view.comm_pending = [[] for _ in ranks], True
    return view


_COMM: dict[tuple, list[list[dict]]] = {}
COMM_CACHED = 128


def comm_at_scale(
    cfg: ParallelConfig, model: ModelConfig, stale: threading.Event | None = None
) -> list[list[dict]] | None:
    """Rows {dim, op, wire_bytes, ...} of one step for one rank per shown stage (buckets merged),
    remembered for the last COMM_CACHED layouts; None if `stale` was set meanwhile."""
    if (cfg, model) in _COMM:
        return _COMM[cfg, model]
    layout = MeshLayout.of(cfg)
    ranks = [layout.rank(pp=s) for s in shown_stages(cfg.pp)]
    # one bucket larger than all the gradients in fp32 (MiB): the ring model is linear in the bytes, so
    # one bucket gives the same totals in one row per op instead of one per bucket
    one_bucket = cfg.replace(bucket_mb=theory.num_params(model) * 4 / 2**20 + 1.0)
    try:  # the walk stops as soon as the controls move on (`stale` set)
        rows_of = theory.rank_comm(one_bucket, model, layout, ranks, stop=stale.is_set if stale else None)
    except theory.Stopped:
        return None
    out = [rows_of[rank] for rank in ranks]
    # the oldest layout out (dicts keep insertion order): a slider moved back and forth finds its own
    if len(_COMM) >= COMM_CACHED:
        _COMM.pop(next(iter(_COMM)))
    _COMM[cfg, model] = out
    return out


def comm_cached(cfg: ParallelConfig, model: ModelConfig) -> bool:
    return (cfg, model) in _COMM


def comm_work(cfg: ParallelConfig, model: ModelConfig) -> int:
    # the walk visits every rank's every parameter tensor: its cost, against SYNC_WORK
    return cfg.world * len(theory.param_shapes(model))
