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


SHARING = {
    # one Slurm of this machine's cores (a second file's job would queue behind the first's), mpiexec,
    # and the two hosts of scripts/netns-hosts.sh (one pair of namespaces with fixed names)
    "test_orphans": "launchers",
    "test_slurm_and_mpiexec": "launchers",
    "test_two_hosts": "launchers",
}
"""Test files that hold one thing of the machine's: under `pytest -n 2 --dist loadgroup` (README) they run
in one worker, one after another. Every other file is a group of its own, so that its module fixtures (a
JupyterLab, a JupyterHub, an 8-engine Lab) start once."""
LONGEST = ("test_browser", "test_notebooks", "test_classroom_hub", "test_faults", "test_compose", "test_compile")
"""The files that take longest (benchmarks/RESULTS.md, "The suite's time"), collected first: with two workers
(`--no-loadscope-reorder` keeps this order) the last file to start is a short one, not the browser's 6 minutes."""


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names each test by its group
def pytest_collection_modifyitems(config, items):
    import torch

    for item in items:
        stem = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SHARING.get(stem, stem)))
    first = {stem: i for i, stem in enumerate(LONGEST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(LONGEST)))  # stable: each file's own order kept
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
