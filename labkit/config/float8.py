"""precision='fp8''s one choice, the recipe (ParallelConfig.fp8_recipe), defined and decoded as
labkit/config/choices.py defines and decodes the others (its `Literal`, the tuple of its values, one
exhaustive `match`): a module of its own, so that choices.py stays one screenful of decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal, get_args

from labkit.config.choices import ConfigError, unknown

Fp8Recipe = Literal["tensorwise", "rowwise", "mxfp8", "delayed"]
FP8_RECIPES: tuple[str, ...] = get_args(Fp8Recipe)
"""How precision='fp8' scales its tensors (torchtitan's [float8] recipe_name, Megatron's --fp8-recipe):
one scale per tensor, or per row (torchao's float8 training); MX block scales and delayed scaling are
named to be refused (`float8_scaling`)."""


@dataclass(frozen=True)
class Float8Scaling:
    """What an `fp8_recipe` scales by (torchao 0.18, torchao/float8/config.py `from_recipe_name`)."""

    rowwise: bool
    """One scale per row of each operand (its amax along the matmul's inner dim, rounded down to a
    power of two), else one per tensor."""
    gathers_fp8: bool
    """FSDP can all-gather the weights already cast to fp8 (torchao's enable_fsdp_float8_all_gather:
    per-tensor scales only; a rowwise weight's scale depends on rows other ranks hold)."""
    not_built: str = ""
    """Why the engines do not run it ('' where they do)."""


@cache
def float8_scaling(recipe: Fp8Recipe) -> Float8Scaling:
    match recipe:
        case "tensorwise":
            return Float8Scaling(rowwise=False, gathers_fp8=True)
        case "rowwise":
            return Float8Scaling(rowwise=True, gathers_fp8=False)
        case "mxfp8":
            # MX (OCP Microscaling v1.0): e8m0 scales per 32 elements, Blackwell's block-scaled matmul
            return Float8Scaling(
                rowwise=False,
                gathers_fp8=False,
                not_built="fp8_recipe='mxfp8' (MX block scales: one e8m0 scale per 32 elements, torchao's "
                "MXLinear, Blackwell's block-scaled matmul) is not built: labkit runs one scale per tensor "
                "or per row; use 'tensorwise' or 'rowwise'",
            )
        case "delayed":
            # Transformer Engine / Megatron: the scale from an amax history of earlier steps
            return Float8Scaling(
                rowwise=False,
                gathers_fp8=False,
                not_built="fp8_recipe='delayed' (Megatron / Transformer Engine's delayed scaling: each scale "
                "from an amax history of earlier steps) is not built: labkit's scales are dynamic, from the "
                "tensor being cast (torchao removed delayed scaling); use 'tensorwise'",
            )
        case _:
            raise ConfigError([unknown("fp8_recipe", recipe, FP8_RECIPES)])
