"""Theory: what a layout costs, predicted without running it (pure Python + numpy, no torch).

    est = theory.estimate(ParallelConfig(dp=4), ModelConfig())
    est.memory[r]        # bytes per category on rank r, like RunResult.ranks[r].memory
    est.comm_table()     # rows like RunResult.comm_table(): per rank x dim x op, one step
    est.bubble_fraction()

For labkit's own implementations the predicted wire bytes and model-state bytes equal the
measured ones exactly, and activations match the saved-tensor meter; tests hold it to that.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit.config import ConfigError, ModelConfig, ParallelConfig, problems
from labkit.engines.mesh import MeshLayout
from labkit.theory import comm as _comm
from labkit.theory.memory import activation_bytes, korthikanti_layer_bytes, model_state_bytes, rank_memory
from labkit.theory.model import num_params, param_shapes
from labkit.theory.pipeline import bubble_fraction as pipeline_bubble


@dataclass
class Estimate:
    config: ParallelConfig
    model: ModelConfig
    world: int
    memory: list[dict]
    """Per rank: bytes of params, grads, optimizer, activations (peak) and peak."""
    comm: list[dict] = field(repr=False)
    """Rows {rank, dim, op, calls, payload_bytes, wire_bytes} for one steady-state step."""
    bubble: float = 0.0

    def comm_table(self) -> list[dict]:
        return self.comm

    def bubble_fraction(self) -> dict:
        return {"per_rank": {r: self.bubble for r in range(self.world)}, "overall": self.bubble}


def estimate(cfg: ParallelConfig, model: ModelConfig | None = None, world: int | None = None) -> Estimate:
    """Predicted memory, communication and bubble of `cfg` on `model`.

    world: the number of ranks (default: the layout's product); extra ranks are idle. Only the
    layout's arithmetic is checked (not whether the engines implement it yet), so any layout
    at any scale can be estimated.
    """
    model = model or ModelConfig()
    found = problems(cfg, model, world)
    if found:
        raise ConfigError(found)
    layout = MeshLayout.of(cfg)
    memory = [rank_memory(cfg, model, layout, r) for r in range(layout.world)]
    c = _comm.Comm()
    _comm.comm_rows(c, cfg, model, layout)
    return Estimate(cfg, model, world or layout.world, memory, c.table(),
                    pipeline_bubble(cfg.pp, cfg.microbatches, cfg.virtual_stages))


__all__ = ["estimate", "Estimate", "model_state_bytes", "activation_bytes", "korthikanti_layer_bytes",
           "num_params", "param_shapes", "pipeline_bubble", "rank_memory"]
