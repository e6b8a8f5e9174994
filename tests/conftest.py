"""Shared fixtures: one real 4-engine ipyparallel cluster (gloo on CPU) for the whole session.
(device="cpu": on a host with a GPU per engine, "auto" would be NCCL, where CPU tensors cannot go.)

Starting engines costs ~15 s on two cores, so every cluster test shares this one; tests use
tiny models so that the suite stays well inside CI's budget.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from labkit import ModelConfig

TINY = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=128, seq=16)
"""Small enough that a 3-step run on 4 gloo engines takes a fraction of a second."""
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def lab():
    from labkit import Lab

    with Lab(engines=4, timeout=120, progress=False, device="cpu") as lab:
        yield lab


@pytest.fixture(scope="session")
def tiny():
    return TINY


@pytest.fixture(scope="session")
def ref_cache():
    """reference() results by arguments, so tests comparing many layouts compute each once."""
    from labkit import reference

    cache = {}

    def get(model=TINY, steps=3, seed=0, global_batch=8, precision="fp32"):
        key = (model, steps, seed, global_batch, precision)
        if key not in cache:
            cache[key] = reference(model, steps=steps, seed=seed, global_batch=global_batch, precision=precision)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def bench_script():
    """Imports a script of benchmarks/ by name. The scripts import each other by bare name, some inside
    their functions, so benchmarks/ stays on sys.path for the whole test module."""
    sys.path.insert(0, BENCHMARKS)
    yield importlib.import_module
    sys.path.remove(BENCHMARKS)
