"""The optimizer (OptimConfig) and one whole run (RunSpec: layout, model, optimizer, steps, data)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import choices, optimizers
from labkit.config.base import _Dict
from labkit.config.choices import Data
from labkit.config.model import ModelConfig
from labkit.config.optimizers import AdjustLr, Optimizer
from labkit.config.parallel import ParallelConfig
from labkit.config.validation import check_fields


@dataclass(frozen=True)
class OptimConfig(_Dict):
    """AdamW (or Muon for the weight matrices, AdamW for the rest) with global-norm gradient clipping; the
    same numbers in every layout and the reference."""

    name: Optimizer = "adamw"
    """'adamw', or 'muon': torch.optim.Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu
    et al. 2025, arXiv 2502.16982) for the blocks' weight matrices, each expert's on its own, and AdamW with
    the fields below for the embeddings, the head, the norms, the biases and the routers
    (labkit/layout/optimizer.py: the rule, written once)."""

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
    muon_lr: float = 1e-3
    """name='muon': Muon's learning rate (torch.optim.Muon's default), before `adjust_lr` scales it."""
    muon_weight_decay: float = 0.1
    """name='muon': Muon's decoupled weight decay, times muon_lr (torch's default)."""
    momentum: float = 0.95
    """name='muon': the momentum buffer's decay (torch's default)."""
    nesterov: bool = True
    """name='muon': Nesterov momentum: the update is the gradient blended toward the buffer (torch's default)."""
    ns_steps: int = 5
    """name='muon': Newton-Schulz iterations, quintic, coefficients (3.4445, -4.775, 2.0315), in bf16 (torch's)."""
    adjust_lr: AdjustLr = "original"
    """name='muon': torch's adjust_lr_fn ('original' for its None): the learning rate times sqrt(max(1, A/B)),
    or 0.2·sqrt(max(A, B)) ('match_rms_adamw'), for an A x B matrix (out x in)."""

    @property
    def kind(self) -> optimizers.OptimizerKind:
        """What `name` runs: .muon."""
        return optimizers.optimizer_kind(self.name)


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
    locate: bool = False
    """Record every module's output and its gradient in the first step (engines/locate.py), and that step's
    reduced gradients, for the oracle to locate where a run leaves the reference (labkit/oracle/locate.py)."""
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
