"""The documents hold to the tree, read as text (no imports of labkit, no cluster): every file
ARCHITECTURE.md's strategy table names exists, every row the issue asks for is there, the ladder
table gives each package of labkit/ the rung tests/test_layers.py gives it, every section a pointer
cites (`DERIVATIONS.md, "The time model"`) is a heading of that document, every link into a
document lands on a heading; README.md stays a newcomer's page (at most 250 lines, every notebook in
its table); and how many comment lines labkit/, widgets/ and engines/ carry."""

from __future__ import annotations

import ast
import io
import json
import pathlib
import re
import tokenize

import pytest
from test_layers import LEVEL, RUNGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARCH = ROOT / "ARCHITECTURE.md"
README = ROOT / "README.md"
DOCS = ("ARCHITECTURE.md", "DERIVATIONS.md", "README.md", "GUIDE.md")
"""The documents whose paths and links are checked against the tree."""
README_LINES = 250
"""README.md's most lines: what labkit is, the set-up, the tour, the notebooks, where to read on;
the rest is GUIDE.md's, ARCHITECTURE.md's, DERIVATIONS.md's or benchmarks/RESULTS.md's."""
COLUMNS = ["strategy", "engine", "layout", "theory", "tests", "notebook"]
STRATEGIES = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP", "FSDP2", "TP", "DTensor", "GPipe", "ZB-H1", "pipelining"]
STRATEGIES += ["CP", "EP", "mesh"]
"""Words each of which some row of the strategy table must name (DDP, ZeRO-1/2/3, FSDP,
TP+SP, the PP schedules, CP, EP and the composed mesh; ours and PyTorch's where both exist)."""
TOP = ("labkit/", "engines/", "widgets/", "tests/", "notebooks/", "benchmarks/", "scripts/", "binder/")
"""A backticked token that starts with one of these is a path from the repository's root."""
NONE = "—"
"""A cell with no file (a strategy with no layout or notebook of its own) starts with this."""


def table(text: str, first: str) -> tuple[list[str], list[list[str]]]:
    """The header and the rows (cells stripped) of the markdown table whose header's first cell is
    `first`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in lines[start:]]
    end = next((i for i, line in enumerate(lines[start:]) if not line.startswith("|")), len(cells))
    return cells[0], cells[2:end]


def paths(cell: str) -> list[str]:
    """The repository paths a cell names: backticked tokens from a top folder, cut at the first
    space or colon (`labkit/cluster/world.py: world_setup`, `tests/test_gpu.py::test_x`)."""
    tokens = re.findall(r"`([^`]+)`", cell)
    return [re.split(r"[\s:]", t)[0] for t in tokens if t.startswith(TOP)]


def test_every_cell_of_the_strategy_table_names_files_that_exist():
    header, rows = table(ARCH.read_text(), "strategy")
    assert header == COLUMNS
    problems = []
    for row in rows:
        assert len(row) == len(COLUMNS), f"a row of {len(row)} cells, not {len(COLUMNS)}: {row}"
        for column, cell in zip(COLUMNS[1:], row[1:]):
            found = paths(cell)
            if not found and not cell.startswith(NONE):
                problems.append(f"{row[0]} / {column}: no file named, and not '{NONE}': {cell!r}")
            problems += [f"{row[0]} / {column}: {p} does not exist" for p in found if not (ROOT / p).exists()]
    assert not problems, "\n".join(problems)
    names = " ".join(r[0] for r in rows)
    assert not [s for s in STRATEGIES if s not in names], "strategies missing from the table"
    # a package is named by its folder ("engines/parallel/context/"), which stands for its __init__.py
    engines = {p + "__init__.py" if p.endswith("/") else p for r in rows for p in paths(r[1])}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "engines" / "parallel").rglob("*.py")}
    # not parallel strategies: the table's "Where is X" names them
    helpers = {"engines/parallel/__init__.py", "engines/parallel/checkpoint.py", "engines/parallel/compile.py"}
    assert not on_disk - engines - helpers, "strategy files the table does not name"


def test_every_path_the_map_and_the_derivations_name_exists():
    missing = [
        f"{doc}: {p}" for doc in DOCS for p in sorted(set(paths((ROOT / doc).read_text()))) if not (ROOT / p).exists()
    ]
    assert not missing, "\n".join(missing)


def test_the_ladder_table_gives_each_package_the_rung_the_layering_test_does():
    _, rows = table(ARCH.read_text(), "rung")
    rung_of = {}
    for row in rows:
        for p in paths(row[1]):
            rung_of[p.rstrip("/")] = int(row[0])
    assert rung_of.get("engines") == LEVEL[RUNGS["engines"]]
    assert rung_of.get("widgets") == LEVEL[RUNGS["widgets"]]
    packages = sorted(p.parent.name for p in (ROOT / "labkit").glob("*/__init__.py"))
    wrong = [
        f"labkit/{name}: the table says {rung_of.get(f'labkit/{name}')}, test_layers {LEVEL[RUNGS[name]]}"
        for name in packages
        if rung_of.get(f"labkit/{name}") != LEVEL[RUNGS[name]]
    ]
    assert not wrong, "\n".join(wrong)


def _texts() -> dict[str, str]:
    """Every text that may cite a document's section: code, tests, benchmarks, the documents, and
    the notebooks' cells (joined, so a pointer wrapped over two lines of a cell is read whole)."""
    out = {}
    for folder in ("labkit", "engines", "widgets", "tests", "benchmarks"):
        out |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / folder).rglob("*.py"))}
    out |= {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.glob("**/*.md")) if _tracked(p)}
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        out[str(p.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    return out


SKIP = ("artifacts", "build", "node_modules")
"""Folders whose markdown is not the repository's own (outputs, installs)."""


def _tracked(p: pathlib.Path) -> bool:
    parts = p.relative_to(ROOT).parts
    return not any(part.startswith(".") or part in SKIP or "venv" in part for part in parts)


def _headings(doc: pathlib.Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


POINTER = re.compile(r"([\w/]+\.md)\)?,?\s+\(?\"([^\"]+)\"")
"""`DERIVATIONS.md, "The time model"`, `DERIVATIONS.md ("What a GPU holds")`,
`benchmarks/RESULTS.md, "Pipelines"`: a document and one of its sections, quoted."""


def test_every_section_a_pointer_cites_is_a_heading():
    """A quoted section is a heading of its document (a part of one: "Pipelines" names "Pipelines
    "), or one of ARCHITECTURE.md's bold-labelled entries ("Meters")."""
    cited, broken = 0, []
    for where, text in _texts().items():
        for doc, section in POINTER.findall(text.replace('\\"', '"')):
            target = ROOT / doc
            if not target.exists():
                target = ROOT / where.rsplit("/", 1)[0] / doc if "/" in where else target
            if not target.exists():
                broken.append(f"{where}: {doc} is not in the repository")
                continue
            cited += 1
            labels = _headings(target) + re.findall(r"^- \*\*(.+?)\*\*", target.read_text(), re.M)
            if not any(_norm(section).rstrip(".") in _norm(label) for label in labels):
                broken.append(f'{where}: {doc}, "{section}" is no heading there')
    assert not broken, "\n".join(broken)
    assert cited >= 5, "the pointer pattern no longer finds the pointers"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")


def test_every_link_into_a_document_lands_on_a_heading():
    broken = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for target, anchor in re.findall(r"\]\(([\w/]*\.md)?#([\w-]+)\)", text):
            slugs = {_slug(h) for h in _headings(ROOT / (target or doc))}
            if anchor not in slugs:
                broken.append(f"{doc}: {target or doc}#{anchor}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_newcomers_page():
    lines = len(README.read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, more than {README_LINES}: move the detail out"


def test_the_readme_lists_every_notebook():
    _, rows = table(README.read_text(), "notebook")
    listed = {row[0].strip("`") for row in rows}
    on_disk = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert listed == on_disk, (
        f"missing from README's table: {sorted(on_disk - listed)}; not on disk: {sorted(listed - on_disk)}"
    )


def comment_density(folder: str) -> tuple[int, int]:
    """(comment lines, code lines) of every .py file under `folder`. A comment line holds a `#`
    comment, alone or after code; a code line holds any other token outside a docstring (a string
    that is a statement of its own: a module's, class's, function's or attribute's docstring)."""
    comments = code = 0
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip |= {tokenize.ENCODING, tokenize.ENDMARKER}
    for path in sorted((ROOT / folder).rglob("*.py")):
        src = path.read_text()
        docstrings = set()
        for node in ast.walk(ast.parse(src)):
            value = getattr(node, "value", None)
            if isinstance(node, ast.Expr) and isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(node.lineno, node.end_lineno + 1))
        commented, coded = set(), set()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                commented.add(tok.start[0])
            elif tok.type not in skip:
                coded.update(r for r in range(tok.start[0], tok.end[0] + 1) if r not in docstrings)
        comments += len(commented)
        code += len(coded)
    return comments, code


def per_100(folder: str) -> float:
    comments, code = comment_density(folder)
    return 100 * comments / code


def test_comment_density_is_measured(capsys):
    """The issue's measure, reported (pytest -s shows it): comment lines per 100 code lines."""
    densities = {folder: per_100(folder) for folder in ("labkit", "widgets", "engines")}
    with capsys.disabled():
        print("\ncomment lines per 100 code lines: " + ", ".join(f"{f}/ {d:.1f}" for f, d in densities.items()))
    assert all(0 < d < 100 for d in densities.values())


@pytest.mark.parametrize("folder", ["labkit", "widgets"])
def test_the_why_is_written_at_the_line(folder):
    """At least 8 comment lines per 100 code lines in labkit/ and in widgets/ (torchtitan
    has 8, picotron 15, nanoGPT 38)."""
    assert per_100(folder) >= 8, f"{folder}/: {per_100(folder):.1f} comment lines per 100 code lines"
