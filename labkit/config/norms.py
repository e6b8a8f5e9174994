"""ModelConfig.norm's choice, defined and decoded as labkit/config/choices.py defines and decodes the
others (its `Literal`, the tuple of its values, one exhaustive `match`): a module of its own, as
labkit/config/float8.py is. The family's default is its Family.rms_norm (choices.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal, get_args

from labkit.config.choices import Arch, ConfigError, family, unknown

Norm = Literal["default", "rmsnorm", "layernorm", "layernorm_nobias"]
NORMS: tuple[str, ...] = get_args(Norm)
"""The blocks' and the head's norms (ModelConfig.norm): the family's, or one a job's arguments name."""


@dataclass(frozen=True)
class NormKind:
    """What ModelConfig.norm builds: RMSNorm (Zhang & Sennrich 2019: a weight) or LayerNorm (Ba et al.
    2016: a weight, and a bias unless told without)."""

    rms: bool
    """RMSNorm rather than LayerNorm."""
    bias: bool
    """A bias beside the weight (LayerNorm's, unless 'layernorm_nobias')."""


@cache
def norm_kind(arch: Arch, norm: Norm) -> NormKind:
    match norm:
        case "default":  # the family's: RMSNorm for the llama-like families, LayerNorm for the GPTs
            rms = family(arch).rms_norm
            return NormKind(rms=rms, bias=not rms)
        case "rmsnorm":
            return NormKind(rms=True, bias=False)
        case "layernorm":  # Megatron-LM's default (--normalization LayerNorm), whatever the MLP and positions
            return NormKind(rms=False, bias=True)
        case "layernorm_nobias":  # OLMo's
            return NormKind(rms=False, bias=False)
        case _:
            raise ConfigError([unknown("norm", norm, NORMS)])
