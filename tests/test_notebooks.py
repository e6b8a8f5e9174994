"""Every notebook in notebooks/ executes on a fresh kernel (nbclient), and is committed stripped.

A notebook's last cells assert what it showed (measured bytes equal the theory, the run equals
the one-process reference), so executing it is a test. Each starts its own Lab (4 engines), so
they run one after another; the kernel runs this interpreter (the same labkit), its cwd is
notebooks/. Strip outputs before committing with `python -m labkit.cli.strip_notebooks`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
from browser_tools import IN_THE_BROWSER, REQUIRED, missing

from labkit.cli.strip_notebooks import strip

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
TIMEOUT_S = 300
"""Per notebook (and per cell): generous for a loaded 2-core CI machine; most take well under a minute."""
NEEDS = {"14_your_job": "torchtitan"}
"""A notebook that runs a framework's own code (an extra): skipped without it, unless CI requires it
(LABKIT_REQUIRE_TORCHTITAN=1 in .ci/run, which installs it)."""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel spec that runs this interpreter, found through JUPYTER_PATH."""
    data = tmp_path_factory.mktemp("jupyter")
    spec = data / "kernels" / "labkit-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "labkit test",
                "language": "python",
            }
        )
    )
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(data))
    yield "labkit-test"
    mp.undo()


def test_there_are_notebooks():
    assert any(p.name.startswith("00_") for p in PATHS), PATHS


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel):
    if path.name in IN_THE_BROWSER and (REQUIRED or not missing()):
        # its cells, asserts included, run once in this suite: in JupyterLab (tests/test_browser.py)
        pytest.skip(f"{path.name} runs whole in the browser test (tests/browser_tools.py IN_THE_BROWSER)")
    need = NEEDS.get(path.stem)
    if need and importlib.util.find_spec(need) is None and not os.environ.get("LABKIT_REQUIRE_TORCHTITAN"):
        install = "pip install --no-deps torchtitan==0.3.0 && pip install -e .[torchtitan]"
        pytest.skip(f"{path.name} runs {need}'s own code: {install}")
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, kernel_name=kernel, timeout=TIMEOUT_S, startup_timeout=120, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    t0 = time.perf_counter()
    with client.setup_kernel():
        try:  # raises CellExecutionError (with the cell and traceback) if a cell fails
            for i, cell in enumerate(nb.cells):
                client.execute_cell(cell, i)
        except BaseException:  # a failed notebook still stops its engines (its teardown cell)
            for i, cell in enumerate(nb.cells):
                if "teardown" in cell.metadata.get("tags", []):
                    try:
                        client.execute_cell(cell, i)
                    except Exception:
                        pass
            raise
    print(f"\n{path.name}: {time.perf_counter() - t0:.1f} s")
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    assert checks and all("assert" in c.source for c in checks), f"{path.name} needs a check cell that asserts"
    assert any("teardown" in c.metadata.get("tags", []) for c in nb.cells), f"{path.name} needs a teardown cell"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_notebook_is_committed_stripped(path):
    nb = json.loads(path.read_text())
    assert not strip(nb), f"{path.name} has outputs or execution counts: run python -m labkit.cli.strip_notebooks"
