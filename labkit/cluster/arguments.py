"""The Lab's arguments checked before any engine work: every problem named, each with a fix
(collected into one ConfigError by the caller)."""

from __future__ import annotations

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.oracle.locate import locate_problems


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def timeout_problems(timeout, name: str = "timeout") -> list[str]:
    if timeout is None:
        return []
    if not _is_real(timeout) or not 0 < timeout < float("inf"):
        return [f"{name}={timeout!r} must be a positive number of seconds (or None for the Lab's default); try 60"]
    return []


def run_problems(cfg, model, optim, steps, seed, timeout, progress, return_params, audit, locate=False) -> list[str]:
    """What is wrong with the arguments of Lab.run (their types; the layout is validation.validate's)."""
    bad = []
    for name, value, kind in (
        ("cfg", cfg, ParallelConfig),
        ("model", model, ModelConfig),
        ("optim", optim, OptimConfig),
    ):
        if not isinstance(value, kind):
            bad.append(
                f"{name}={value!r} must be a {kind.__name__} (e.g. {kind.__name__}()), not {type(value).__name__}"
            )
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        bad.append(f"steps={steps!r} must be a positive integer; try steps=3")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        bad.append(f"seed={seed!r} must be an integer in [0, 2**63); try seed=0")
    bad += timeout_problems(timeout)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        bad.append(f"progress={progress!r} must be True, False, None or a function of one record")
    for name, value in (("return_params", return_params), ("audit", audit)):
        if not isinstance(value, bool):
            bad.append(f"{name}={value!r} must be True or False")
    # what locate=True cannot locate yet (labkit/oracle/locate.py), once the configs are what they must be
    return bad or locate_problems(cfg, model, locate)
