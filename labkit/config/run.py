"""The optimizer (OptimConfig) and one whole run (RunSpec: layout, model, optimizer, steps, data)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import choices
from labkit.config.base import _Dict
from labkit.config.choices import (
    Data,
)
from labkit.config.model import ModelConfig
from labkit.config.parallel import ParallelConfig
from labkit.config.validation import check_fields


@dataclass(frozen=True)
class OptimConfig(_Dict):
    """AdamW with global-norm gradient clipping; the same numbers in every layout and the reference."""

    lr: float = 3e-3
    """Learning rate (constant: no schedule, so steps compare one to one)."""
    beta1: float = 0.9
    beta2: float = 0.95
    """Adam moments' decay rates (GPT-3's betas)."""
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (>= 2-D) only, as nanoGPT does."""
    clip: float = 1.0
    """Max global gradient norm (all shards, each parameter counted once); 0 disables clipping."""


@dataclass(frozen=True)
class RunSpec(_Dict):
    """One training run as every engine receives it: Lab.run builds it, engines/train.py
    `run_rank` runs it (the dry run and the torchrun benchmark too). Its `to_dict()` is what
    crosses to the engines: plain data, the three configs nested as their own dicts."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The layout of the strategies on the mesh."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """What to train: the full model every rank builds from the seed and then slices."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimizer and its clipping, the same as the reference's."""
    steps: int = 3
    """Optimizer steps to train."""
    seed: int = 0
    """Seeds the initial weights and the batches (the same on every rank and in the reference)."""
    data: Data = "synthetic"
    """'synthetic' (the synthetic language) or 'text' (the corpus; the ranks also compute the validation loss)."""
    return_params: bool = False
    """Bring back every rank's part of the final parameters (res.params), to check against the reference."""
    return_grads: bool = False
    """Bring back every step's reduced gradients too (res.step_grads), which the oracle replays
    (labkit/oracle/replay.py): what Lab.run's return_params=True asks; a text run's parameters alone
    (for generate) do not, so a long run on text ships no step's gradients."""
    audit: bool = False
    """Run a TorchDispatchMode beside the comm meter and count what it sees (slow; tests use it)."""
    comm_log: bool = True
    """Record collectives in the job's log; False only for the overhead benchmark (nothing is recorded)."""

    def __post_init__(self):
        check_fields(self)

    @property
    def trains_on_text(self) -> bool:
        """data='text': the corpus, and the ranks compute the validation loss."""
        return choices.trains_on_text(self.data)

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        """The nested configs come back as dataclasses (to_dict made them dicts)."""
        nested = {"parallel": ParallelConfig, "model": ModelConfig, "optim": OptimConfig}
        return super().from_dict({k: nested[k].from_dict(v) if k in nested else v for k, v in d.items()})
