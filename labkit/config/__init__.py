"""Plain-data configuration: what to train and how to lay it out.

This module is the bottom rung of labkit's import ladder: the engines import it, so it
imports nothing but the standard library. Every config round-trips through a plain dict
(`to_dict` / `from_dict`); that dict is what crosses from the notebook to the engines. A choice
field is a `Literal` whose names are decoded once (choices.py) into the properties the code reads
(`cfg.sharded`, `cfg.pipeline`, `model.family`, ...: derived, never in the dict); every field is
checked when a config is built (validation.py), so a config that exists has fields of the right
type and range. The configs live in model.py (ModelConfig), parallel.py (ParallelConfig) and run.py
(OptimConfig, RunSpec), on base.py's dict round trip; this module is their one import point.
"""

from __future__ import annotations

from labkit.config import choices  # noqa: F401  (labkit.config.choices, as before the split)
from labkit.config.choices import (
    ARCHS,
    CHECKPOINTING,
    CONTEXT_KINDS,
    DATA,
    DIMS,
    IMPLS,
    LOSSES,
    PRECISIONS,
    SCHEDULES,
    SHARDINGS,
    ConfigError,
)
from labkit.config.model import ModelConfig, RopeScaling
from labkit.config.parallel import ParallelConfig
from labkit.config.run import OptimConfig, RunSpec

__all__ = [
    "ARCHS",
    "CHECKPOINTING",
    "CONTEXT_KINDS",
    "DATA",
    "DIMS",
    "IMPLS",
    "LOSSES",
    "PRECISIONS",
    "SCHEDULES",
    "SHARDINGS",
    "ConfigError",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RopeScaling",
    "RunSpec",
]
