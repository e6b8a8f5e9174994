"""What a run is held to: the reference replayed along it where it brought every step's gradients back
(labkit/oracle/replay.py), else the plain reference's first step; and the bounds of its precision
(labkit/oracle/bounds.py). The checks (checks.py) read both from here.
"""

from __future__ import annotations

import weakref

import numpy as np

from labkit.config.choices import numerics
from labkit.oracle.bounds import Bounds, bounds, paths
from labkit.oracle.bounds_fp8 import reference_problems
from labkit.oracle.replay import replay


def replayed(result, ref):
    """`ref` replayed along `result` (labkit/oracle/replay.py), once per pair: None where the run brought
    back no gradients of its later steps (return_params=False, or a result read from a file)."""
    if not result.step_grads or len(result.step_grads) != result.steps:
        return None
    key = (id(result), id(ref))
    if key not in _REPLAYS:
        _REPLAYS[key] = replay(result, ref)
        # gone with either: an id is reused once its object is collected
        weakref.finalize(result, _REPLAYS.pop, key, None)
        weakref.finalize(ref, _REPLAYS.pop, key, None)
    return _REPLAYS[key]


_REPLAYS: dict[tuple[int, int], object] = {}


def judged(result, ref, within: Bounds | None = None):
    """(the reference the run is held to, its bounds): the replay where the run brought its gradients back,
    with one step's bounds at every step; else the plain reference, whose steps after the first are held
    by nothing (the optimizer's amplification of a rounding, replay.py), and `ref`'s first step alone."""
    if numerics(result.config.precision).fp8:
        wrong = reference_problems(result.config, ref)
        if wrong:
            raise ValueError(wrong[0])
    elif numerics(ref.precision).mixed:
        raise ValueError(
            f"the oracle is the fp32 reference (reference(..., precision='fp32')), not {ref.precision!r}: "
            "bf16 runs are held to bounds derived against it (labkit/oracle/bounds.py)"
        )
    # bf16's bounds grow with the roundings on each gradient's chain, counted on the computation (bounds.paths)
    mixed = numerics(result.config.precision).mixed
    b = within or bounds(
        result.config.precision,
        paths(result.model, result.config) if mixed else None,
        result.config,
        result.model.layers,
    )
    rep = replayed(result, ref)
    return (rep if rep is not None else ref), b


def held_steps(result, held) -> int:
    """How many steps' losses and norms are held: every step under a replay, the first alone against a
    plain reference (after one update the optimizer has amplified a rounding: replay.py)."""
    return len(held.losses) if held.replayed is not None else min(1, len(held.losses))


def ratio(e: float, scale: float) -> float:
    # error over its floored scale (bounds.tensor_errors): a zero scale is exact with no error, else inf
    return e / scale if scale else (0.0 if e == 0 else np.inf)


def gradient_pairs(result, held) -> list[tuple[dict, dict]]:
    """(run's, reference's) gradients of every step held: all of them under a replay, the first alone else."""
    if held.step_grads and result.step_grads and len(held.step_grads) == len(result.step_grads):
        return list(zip(result.step_grads, held.step_grads))
    return [(result.grads, held.first_grads)] if result.grads is not None and held.first_grads else []
