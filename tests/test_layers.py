"""The import ladder, read off the source files (pure: no imports are executed).

labkit.plans is torch-free and imports only the standard library, numpy, labkit.config and
itself; labkit.theory never imports torch or labkit.engines; and the files of labkit.theory,
labkit.plans and engines/parallel form no import cycle, counting function-level imports.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"labkit.plans": ROOT / "labkit" / "plans", "labkit.theory": ROOT / "labkit" / "theory",
            "labkit.engines.parallel": ROOT / "engines" / "parallel"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module `path` imports, anywhere in the file; `from pkg import mod` names pkg.mod."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else node.module)
    return out


def test_plans_and_theory_stay_off_torch_and_the_engines():
    known = modules()
    for name, path in known.items():
        found = imports(path, known)
        if name.startswith("labkit.plans"):
            allowed = lambda m: (m.split(".")[0] in sys.stdlib_module_names or m.split(".")[0] == "numpy"  # noqa: E731
                                 or m == "labkit.config" or m.startswith("labkit.plans"))
            assert all(allowed(m) for m in found), (name, sorted(m for m in found if not allowed(m)))
        if name.startswith("labkit.theory"):
            bad = [m for m in found if m.split(".")[0] == "torch" or m.startswith("labkit.engines")]
            assert not bad, (name, bad)


def test_no_import_cycles_among_theory_plans_and_strategies():
    known = modules()
    graph = {n: sorted(m for m in imports(p, known) if m in known and m != n) for n, p in known.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in graph[n]:
            assert state.get(m) != 1, " -> ".join(path[path.index(m):] + [n, m])
            if m not in state:
                visit(m, path + [n])
        state[n] = 2

    for n in graph:
        if n not in state:
            visit(n, [])
