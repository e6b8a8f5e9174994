"""OptimConfig's choices, the optimizer and Muon's learning-rate rule, defined and decoded as
labkit/config/choices.py defines and decodes the others (its `Literal`, the tuple of its values, one
exhaustive `match`): a module of its own, as labkit/config/float8.py is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Literal, get_args

from labkit.config.choices import ConfigError, unknown

Optimizer = Literal["adamw", "muon"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
"""OptimConfig.name: AdamW everywhere, or Muon for the blocks' weight matrices (AdamW for the rest)."""
AdjustLr = Literal["original", "match_rms_adamw"]
ADJUST_LRS: tuple[str, ...] = get_args(AdjustLr)
"""torch.optim.Muon's adjust_lr_fn: the learning rate scaled by sqrt(max(1, A/B)) (Jordan et al.'s), or by
0.2·sqrt(max(A, B)) (Liu et al. 2025, Moonlight: the update's RMS that of AdamW's), A x B the matrix."""


@dataclass(frozen=True)
class OptimizerKind:
    """What OptimConfig.name runs."""

    muon: bool
    """Muon (torch.optim.Muon) for the weight matrices labkit/layout/optimizer.py routes to it."""


@cache
def optimizer_kind(name: Optimizer) -> OptimizerKind:
    match name:
        case "adamw":
            return OptimizerKind(muon=False)
        case "muon":
            return OptimizerKind(muon=True)
        case _:
            raise ConfigError([unknown("name", name, OPTIMIZERS)])


def muon_lr_ratio(adjust: AdjustLr, rows: int, cols: int) -> float:
    """What Muon multiplies its learning rate by for a rows x cols matrix (out x in: a Linear's weight),
    as torch 2.13's torch.optim._muon._adjust_lr computes it."""
    match adjust:
        case "original":
            return math.sqrt(max(1, rows / cols))
        case "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        case _:
            raise ConfigError([unknown("adjust_lr", adjust, ADJUST_LRS)])
