"""The house rules, read off the source with `ast` (no imports run): the one-way ladder of
packages, no import cycles (function-level imports counted), torch-free layout and theory, files
under 400 lines, and no pointer to a document outside the repository (ARCHITECTURE.md has the map)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"labkit": "labkit", "engines": "labkit.engines", "widgets": "labkit.widgets"}

RUNGS = {
    "config": "config",  # plain data, its checks, its display
    "layout": "layout",  # the torch-free decisions engines, simulator and theory share
    "engines": "engines",  # what runs on every rank
    "theory": "theory",  # the same quantities predicted
    "cluster": "orchestration",  # the Lab, engines, jobs, faults
    "oracle": "orchestration",  # the reference, assembly, bounds, checks
    "results": "orchestration",  # what runs return, and their views
    "widgets": "widgets",
    "cli": "cli",
}
"""The rung of each package under labkit (its first name below `labkit.`): a module's rung is its
package's, so a new module needs no list; `labkit` itself (the public facade) is orchestration."""
LEVEL = {"config": 0, "layout": 1, "engines": 2, "theory": 2, "orchestration": 3, "widgets": 4, "cli": 5}
"""The ladder, bottom first; a module may import its own rung and the rungs below it, except that
engines and theory stand side by side and never import each other."""
UPWARD = {("labkit.oracle.verify_report", "labkit.widgets.verify_figure")}
"""Imports up the ladder allowed by name, each inside a function: VerifyReport.figure()
draws the report with the builder that shares every other figure's style."""
FORBIDDEN = {
    "layout": ("torch", "ipyparallel", "ipywidgets", "plotly"),
    "theory": ("torch", "ipyparallel", "ipywidgets", "plotly"),
    "config": ("torch", "numpy", "ipyparallel", "ipywidgets", "plotly"),
    "engines": ("ipyparallel", "ipywidgets", "plotly", "IPython"),
    "widgets": ("torch.distributed",),
}
"""Third-party packages a rung never imports (DESIGN: the theory is instant and torch-free; the
engines run on ranks without the notebook's packages; the widgets never talk to a process group)."""


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def house_files(folder: str) -> list[pathlib.Path]:
    """The folder's Python files that are labkit's own: a third_party/ folder holds someone else's script
    as published (tests/data/scripts/README.md: fetched by hand, git-ignored), which no house rule reshapes."""
    return [p for p in sorted((ROOT / folder).rglob("*.py")) if "third_party" not in p.relative_to(ROOT).parts]


def rung(module: str) -> str:
    parts = module.split(".")
    if parts == ["labkit"]:
        return "orchestration"
    return RUNGS[parts[1]]


def _type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return isinstance(t, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(t)


def imports(path: pathlib.Path):
    """(imported name, line, at module level?) for every import, TYPE_CHECKING blocks excepted
    (they never run)."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.extend((f"{child.module}.{a.name}", child.lineno, top) for a in child.names)
            else:
                nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, top and not nested)

    visit(tree, True)
    return out


def graph():
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    external: dict[str, list[tuple[str, int]]] = {m: [] for m in mods}
    for m, path in mods.items():
        for name, line, _ in imports(path):
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if not target:
                external[m].append((name, line))
            elif target != m and not m.startswith(target + "."):  # a package's own __init__
                edges[m].add(target)
    return mods, edges, external


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    _, edges, _ = graph()
    found = cycles(edges)
    assert not found, "import cycles (function-level imports counted): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_ladder_is_one_way():
    mods, edges, external = graph()
    wrong = []
    for m, targets in edges.items():
        a = rung(m)
        for t in targets:
            b = rung(t)
            if (m, t) in UPWARD:
                continue
            if LEVEL[b] > LEVEL[a] or (LEVEL[a] == LEVEL[b] and a != b):
                wrong.append(f"{m} ({a}) imports {t} ({b})")
    for m, names in external.items():
        for name, line in names:
            for bad in FORBIDDEN.get(rung(m), ()):
                if name == bad or name.startswith(bad + "."):
                    wrong.append(f"{mods[m].relative_to(ROOT)}:{line} ({rung(m)}) imports {name}")
    assert not wrong, "imports against the ladder (ARCHITECTURE.md):\n" + "\n".join(sorted(wrong))


def test_the_upward_imports_named_are_there_and_inside_functions():
    """UPWARD cannot go stale or widen: each named import exists, and only inside a function."""
    mods, edges, _ = graph()
    for m, t in UPWARD:
        assert t in edges[m], f"{m} no longer imports {t}: drop it from UPWARD"
        at_top = [top for name, _, top in imports(mods[m]) if name == t or name.startswith(t + ".")]
        assert at_top and not any(at_top), f"{m} imports {t} at module level"


def test_every_module_lives_in_a_package_of_the_ladder():
    """labkit/ holds packages only (and its facade, __init__): a module dropped at the top or a
    new package not given a rung here is found."""
    stray = [m for m in modules() if m != "labkit" and m.split(".")[1] not in RUNGS]
    assert not stray, f"give these a package of the ladder (RUNGS): {stray}"
    assert sorted({m.split(".")[1] for m in modules() if m != "labkit"}) == sorted(RUNGS)


def test_the_ladder_catches_what_it_should():
    """The checks above can fail: a made-up upward edge and a made-up cycle are both found."""
    assert rung("labkit.theory.exact.comm") == "theory" and rung("labkit.cluster.lab") == "orchestration"
    assert rung("labkit.widgets.figures") == "widgets" and rung("labkit.layout.mesh") == "layout"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


HEAVY = (
    "torch",
    "torch.distributed.tensor",  # DTensor's runtime: ~45 MB more in every engine that imports it
    "ipyparallel",
    "plotly",
    "ipywidgets",
    "anywidget",
    "IPython",
    "cloudpickle",
    "nbformat",
    "nbclient",
    "playwright",
    "transformers",
    "torchao",
    "pandas",
    "traitlets",
    "zmq",
)
"""Dependencies worth deferring: slow to import, or absent where a module must also work."""


def heavy_at_import() -> dict[str, set[str]]:
    """Per module: the heavy packages that importing it loads (module-level imports, transitively)."""
    mods, _, _ = graph()
    top: dict[str, tuple[set[str], set[str]]] = {}
    for m, path in mods.items():
        own, ext = set(), set()
        for name, _, at_top in imports(path):
            if not at_top:
                continue
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m and not m.startswith(target + "."):
                own.add(target)
            elif not target:
                ext |= {h for h in HEAVY if name == h or name.startswith(h + ".")}
        top[m] = (own, ext)
    memo: dict[str, set[str]] = {}

    def load(m, seen=()):
        if m not in memo:
            own, ext = top[m]
            memo[m] = set(ext).union(*(load(t, seen + (m,)) for t in own if t not in seen))
        return memo[m]

    return {m: load(m) for m in mods}


def test_function_level_imports_defer_heavy_dependencies_only():
    """Imports go at the top; one inside a function is there only to defer a heavy dependency
    (torch, ipyparallel, plotly, ...) that importing the module itself must not load."""
    mods, _, _ = graph()
    heavy = heavy_at_import()
    wrong = []
    for m, path in mods.items():
        for name, line, at_top in imports(path):
            if at_top:
                continue
            target = name
            while target and target not in mods:
                target = target.rpartition(".")[0]
            defers = heavy[target] - heavy[m] if target else {h for h in HEAVY if name == h or name.startswith(h + ".")}
            if not defers:
                wrong.append(
                    f"{path.relative_to(ROOT)}:{line} imports {name} inside a function, deferring nothing heavy"
                )
    assert not wrong, "move these to the top of the file:\n" + "\n".join(wrong)


def test_the_notebook_kernel_never_loads_torch():
    """What the kernel imports (the Lab, its engine set, results, the reference, the theory, the
    widgets) loads no torch: a Binder tab has 2 GB, and torch alone is ~300 MB resident. The
    engines import torch; the Lab names their functions without loading it."""
    heavy = heavy_at_import()
    loads = sorted(
        m
        for m in heavy
        if rung(m) in ("orchestration", "widgets", "cli", "theory", "layout", "config") and "torch" in heavy[m]
    )
    assert not loads, "these load torch when imported in the kernel: " + ", ".join(loads)


def test_layout_imports_only_the_standard_library_numpy_and_config():
    import sys

    mods, edges, external = graph()
    wrong = [
        f"{m} imports {name}"
        for m in mods
        if rung(m) == "layout"
        for name, _ in external[m]
        if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "numpy"
    ]
    wrong += [
        f"{m} imports {t}" for m in mods if rung(m) == "layout" for t in edges[m] if rung(t) not in ("config", "layout")
    ]
    assert not wrong, "labkit.layout is the shared, torch-free rung:\n" + "\n".join(wrong)


@pytest.mark.parametrize("folder", ["labkit", "engines", "widgets", "tests", "benchmarks"])
def test_files_stay_short(folder):
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in house_files(folder)
        if (n := len(p.read_text().splitlines())) > 400
    ]
    assert not long, "split these by responsibility: " + ", ".join(long)


def test_no_pointer_outside_the_repository():
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for folder in ("labkit", "engines", "widgets", "tests", "benchmarks")
        for p in house_files(folder)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "DESIGN" + ".md" in line
    ]
    assert not hits, "that document is not in the repository; point at ARCHITECTURE.md: " + ", ".join(hits)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff_keeps_the_house(command):
    """ruff (the rule set is in pyproject.toml) passes on the whole repository, notebooks included."""
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    assert ruff, "ruff is in the test extras: pip install -e '.[test]'"
    out = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


def test_every_package_folder_is_installed():
    """pyproject.toml names its packages one by one (engines/ and widgets/ install as labkit.engines and
    labkit.widgets, which a find cannot map): a new sub-package missing there would import from the
    checkout and be absent from a wheel."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {}
    for folder, pkg in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([pkg, *rel.parts])] = init.parent.relative_to(ROOT).as_posix()
    assert sorted(tool["packages"]) == sorted(found), "pyproject.toml [tool.setuptools] packages"
    assert tool["package-dir"] == found, "pyproject.toml [tool.setuptools.package-dir]"
