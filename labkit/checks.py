"""Comparisons against the reference, shared by tests, notebooks and benchmarks."""
from __future__ import annotations

import numpy as np

FP32_RTOL = 1e-5
BF16_RTOL = 2e-2


def rtol_for(precision: str) -> float:
    return BF16_RTOL if precision == "bf16" else FP32_RTOL


def reference_shards(cfg) -> int:
    """The `shards` a reference needs to compute a layout's arithmetic (labkit/reference.py): under
    bf16 every data shard and microbatch rounds its own gradient, so the reference splits the batch
    the same way (dp * ep * microbatches); in fp32 the whole batch at once (1)."""
    return cfg.dp * cfg.ep * cfg.microbatches if cfg.precision == "bf16" else 1


def loss_errors(losses, ref_losses) -> list[float]:
    """Relative error of each step's loss."""
    return [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]


def param_errors(params: dict, ref_params: dict) -> dict[str, float]:
    """Relative error of each parameter tensor: ||p - p_ref||_2 / ||p_ref||_2.

    A vector norm, not an element-wise bound: AdamW divides each gradient element by its own
    running RMS, so an element whose gradient is nearly zero moves by up to lr in a direction
    set by rounding. Splitting a batch in two within one process already moves such an
    element of wq by 8e-7 (1e-5 of the tensor's largest entry), with no parallelism involved;
    the tensor's relative error stays ~1e-7. A real bug (a missing average, a wrong shard)
    gives 1e-2 and more.
    """
    missing = set(ref_params) - set(params)
    if missing:
        raise AssertionError(f"parameters missing from the run: {sorted(missing)}")
    return {k: float(np.linalg.norm(params[k] - ref_params[k]) / max(np.linalg.norm(ref_params[k]), 1e-30))
            for k in ref_params}


def assert_matches(result, ref, rtol: float | None = None) -> None:
    """Losses (each step) and, when the run returned them, final parameters within rtol."""
    rtol = rtol if rtol is not None else rtol_for(result.config.precision)
    errs = loss_errors(result.losses, ref.losses)
    if len(result.losses) != len(ref.losses) or max(errs) > rtol:
        raise AssertionError(f"losses differ from the reference beyond {rtol:g}: run {result.losses} "
                             f"vs reference {ref.losses} (relative errors {errs})")
    if result.params is not None:
        perr = param_errors(result.params, ref.params)
        worst = max(perr, key=perr.get)
        if perr[worst] > rtol:
            raise AssertionError(f"parameter {worst} differs from the reference by {perr[worst]:.3g} "
                                 f"(relative L2) > {rtol:g}")
