"""Binder's environment agrees with pyproject.toml (no cluster needed).

repo2docker installs binder/requirements.txt, then runs binder/postBuild (`pip install -e .`).
Every runtime dependency must be in the requirements with the same specifier, torch pinned to a
CPU build that pyproject's range accepts, and postBuild must install the project itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10: tomli, the same parser, is a test dependency there (pyproject.toml)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"


def pyproject_deps() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


def binder_reqs() -> tuple[dict[str, Requirement], list[str]]:
    reqs, options = {}, []
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        r = Requirement(line)
        reqs[canonicalize_name(r.name)] = r
    return reqs, options


def test_every_runtime_dependency_is_in_binder_with_the_same_specifier():
    reqs, _ = binder_reqs()
    for name, dep in pyproject_deps().items():
        assert name in reqs, f"{name} is a dependency in pyproject.toml but not in binder/requirements.txt"
        if name != "torch":
            assert reqs[name].specifier == dep.specifier, (name, str(reqs[name].specifier), str(dep.specifier))
    assert set(reqs) <= set(pyproject_deps()), "binder installs something pyproject does not declare"


def test_torch_is_a_cpu_build_that_pyproject_accepts():
    reqs, options = binder_reqs()
    pins = [s for s in reqs["torch"].specifier if s.operator == "=="]
    assert len(pins) == 1, f"pin torch to one version in binder: {reqs['torch']}"
    assert pyproject_deps()["torch"].specifier.contains(pins[0].version), (
        pins[0].version,
        str(pyproject_deps()["torch"].specifier),
    )
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in options


def test_postbuild_installs_the_project_with_what_the_notebooks_need():
    """The project itself, with the [hf] extra (notebooks/12 builds a Hugging Face model) and the
    [fp8] extra (notebooks/16 trains with torchao), extras that pyproject.toml declares."""
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK), "binder/postBuild must be executable"
    commands = [line.strip() for line in post.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert any("pip install" in c and c.endswith('-e ".[hf,fp8]"') for c in commands), commands
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(canonicalize_name(Requirement(r).name) == "transformers" for r in extras["hf"])
    assert any(canonicalize_name(Requirement(r).name) == "torchao" for r in extras["fp8"])
