"""What Muon changes in a rank's bytes (OptimConfig name='muon'; engines/muon.py executes it): its state is one
fp32 momentum buffer a parameter, not Adam's two (4 bytes, not 8), and a tp rank gathers each slice of a Muon
matrix it holds from its tp group before Newton-Schulz, once a step, in bf16 (the cast Newton-Schulz begins
with: 2 bytes an element). Which parameters: labkit/layout/optimizer.py `takes_muon`, the engines' rule.

Newton-Schulz's FLOPs, per iteration for an A x B matrix with A <= B: the Gram matrix X Xᵀ (2A²B), its square
(2A³) and that times X (2A²B): 4A²B + 2A³ (Jordan et al. 2024; Liu et al. 2025, section 2.2).
"""

from __future__ import annotations

from math import prod

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.layout.optimizer import matrices, takes_muon
from labkit.theory.exact.model import param_shapes
from labkit.theory.exact.params import rank_entries

STATE = {"adamw": 8, "muon": 4}
"""Optimizer-state bytes per element: Adam's two fp32 moments, Muon's one fp32 momentum."""
GATHER = 2
"""Bytes of a gathered update element: bf16."""


def muon_names(model: ModelConfig, optim: OptimConfig | None) -> frozenset[str]:
    """The parameters Muon updates (none without it)."""
    if optim is None or not optim.kind.muon:
        return frozenset()
    return frozenset(n for n, s in param_shapes(model) if takes_muon(n, s))


def state_per_element(name: str, muon: frozenset[str]) -> int:
    """Optimizer-state bytes of one element of parameter `name`."""
    return STATE["muon"] if name in muon else STATE["adamw"]


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout, optim: OptimConfig | None) -> None:
    """A tp rank's all-gathers of its Muon slices: one per tp-split Muon parameter a step, its every tp rank's
    slice (local elements x tp) at 2 bytes."""
    muon = muon_names(model, optim)
    if not muon or cfg.tp == 1:
        return
    full = dict(param_shapes(model))

    def ops(pp_rank: int) -> list[tuple]:
        out = []
        for name, shape, _, _ in rank_entries(cfg, model, pp_rank):
            whole = full.get(name)
            if name in muon and tuple(shape) != tuple(whole) and len(whole) == 2:
                out.append(("tp", "all_gather", prod(shape) * cfg.tp * GATHER, cfg.tp, 1))
        return out

    comm.per_stage(layout, ops)


def newton_schulz_flops(model: ModelConfig, optim: OptimConfig | None) -> int:
    """FLOPs of one step's Newton-Schulz over every Muon matrix of the whole model (each orthogonalized once
    by each rank that holds it whole)."""
    out = 0
    for name, shape in param_shapes(model):
        if name in muon_names(model, optim):
            for rows, cols in matrices(name, shape):
                a, b = min(rows, cols), max(rows, cols)
                out += optim.ns_steps * (4 * a * a * b + 2 * a**3)
    return out
