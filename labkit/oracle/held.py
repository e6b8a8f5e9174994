"""What a run is held to: the reference replayed along it where it brought every step's gradients back
(labkit/oracle/replay.py), else the reference's first step; each computed in the arithmetic the run's
reference computes in (labkit/oracle/arithmetic.py), with the bounds of that arithmetic
(labkit/oracle/bounds.py). The checks (checks.py) read both from here.
"""

from __future__ import annotations

import weakref

import numpy as np

from labkit.config.choices import numerics
from labkit.oracle.arithmetic import arithmetic, extra_roundings, first_shared
from labkit.oracle.bounds import Bounds, bounds, paths, shared_bounds
from labkit.oracle.reference import train
from labkit.oracle.replay import replay


def replayed(result, ref):
    """`ref` replayed along `result` in the run's reference arithmetic (labkit/oracle/replay.py), once per
    pair: None where the run brought back no gradients of its later steps (return_params=False, or a
    result read from a file)."""
    if not result.step_grads or len(result.step_grads) != result.steps:
        return None
    return _once(("replay", id(result), id(ref)), result, ref, lambda: replay(result, ref, arithmetic(result)))


def first_step(result, ref, arith=None):
    """The first step of `ref`'s training computed in the run's reference arithmetic (or `arith`), once per
    pair: what a run without every step's gradients is held to (after one update the optimizer has
    amplified a rounding, replay.py)."""
    arith = arith or arithmetic(result)

    def compute():
        known = lambda mine, run: run if mine is None else mine  # noqa: E731 - a field an older Reference lacks
        import torch  # the reference trains here (the oracle's import does not load torch)

        before = torch.get_num_threads()
        if arith.threads is not None:
            torch.set_num_threads(arith.threads)
        try:
            return train(
                ref.model,
                1,
                known(ref.seed, result.seed),
                known(ref.global_batch, result.config.global_batch),
                arith.precision,
                known(ref.optim, result.optim),
                arith.shards,
                ref.data,
                fp8_recipe=result.config.fp8_recipe,
                microbatches=arith.microbatches,
                spread=arith.shared,
            )
        finally:
            torch.set_num_threads(before)

    return _once(("first", id(result), id(ref), arith), result, ref, compute)


def _once(key, result, ref, compute):
    if key not in _HELD:
        _HELD[key] = compute()
        # gone with either: an id is reused once its object is collected
        weakref.finalize(result, _HELD.pop, key, None)
        weakref.finalize(ref, _HELD.pop, key, None)
    return _HELD[key]


_HELD: dict[tuple, object] = {}


def judged(result, ref, within: Bounds | None = None):
    """(the reference the run is held to, its bounds): the replay where the run brought its gradients back,
    with one step's bounds at every step; else the first step alone, whose steps after it are held by
    nothing (the optimizer's amplification of a rounding, replay.py). `ref` gives the model, seed, global
    batch, optimizer and data; the arithmetic is the run's reference's, whatever `ref` computed in."""
    rep = replayed(result, ref)
    held = rep if rep is not None else first_step(result, ref)
    if within is not None:
        return held, within
    mixed = numerics(result.config.precision).mixed
    # bf16's bounds against the fp32 (or fp8) reference grow with the roundings on each gradient's chain,
    # counted on the computation (bounds.paths); with the run's own arithmetic only the reduction's differ
    general = bounds(
        result.config.precision,
        paths(result.model, result.config) if mixed else None,
        result.config,
        result.model.layers,
    )
    if held.step_spread:
        return held, shared_bounds(held, extra_roundings(result), general)
    return held, general


def judged_first(result, ref):
    """(the first step in the run's own arithmetic, its shared bounds) where only the first step's arithmetic
    is one process's (arithmetic.first_shared: FSDP2 in bf16), else None: that step held to one rounding
    beside the counted bounds of every step."""
    arith = first_shared(result)
    if arith is None:
        return None
    held = first_step(result, ref, arith)
    return held, shared_bounds(held, extra_roundings(result), bounds(result.config.precision, paths(result.model)))


def held_steps(result, held) -> int:
    """How many steps' losses and norms are held: every step under a replay, the first alone else
    (after one update the optimizer has amplified a rounding: replay.py)."""
    return len(held.losses) if held.replayed is not None else min(1, len(held.losses))


def ratio(e: float, scale: float) -> float:
    # error over its floored scale (bounds.tensor_errors): a zero scale is exact with no error, else inf
    return e / scale if scale else (0.0 if e == 0 else np.inf)


def gradient_pairs(result, held) -> list[tuple[dict, dict]]:
    """(run's, reference's) gradients of every step held: all of them under a replay, the first alone else."""
    if held.step_grads and result.step_grads and len(held.step_grads) == len(result.step_grads):
        return list(zip(result.step_grads, held.step_grads))
    return [(result.grads, held.first_grads)] if result.grads is not None and held.first_grads else []
