"""labkit: a Jupyter-first lab for the parallel training of large models.

from labkit import Lab, ParallelConfig, ModelConfig, reference, theory
"""

from labkit import theory
from labkit.cluster.errors import Cancelled, CollectiveTimeout, EngineDied, LabError, RankError, ScriptFailed
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig
from labkit.config.validation import validate
from labkit.oracle.reference import Reference, reference
from labkit.results.dryrun import dry_run
from labkit.results.measurement import Measurement
from labkit.results.run import CommEvent, Event, RankReport, RunResult
from labkit.results.script import ScriptResult


def __getattr__(name):
    if name == "Lab":
        from labkit.cluster.lab import (
            Lab,  # deferred: ipyparallel, so that theory-only users stay light
        )

        return Lab
    if name in ("track", "region"):  # called inside lab.measure and lab.torchrun's scripts: they import torch
        from labkit.engines import tracking

        return getattr(tracking, name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


__all__ = [
    "Lab",
    "Measurement",
    "ScriptResult",
    "ScriptFailed",
    "track",
    "region",
    "dry_run",
    "ParallelConfig",
    "ModelConfig",
    "OptimConfig",
    "ConfigError",
    "validate",
    "reference",
    "Reference",
    "theory",
    "RunResult",
    "RankReport",
    "CommEvent",
    "Event",
    "LabError",
    "RankError",
    "EngineDied",
    "CollectiveTimeout",
    "Cancelled",
]
