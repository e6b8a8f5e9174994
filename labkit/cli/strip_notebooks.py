"""Strip outputs and execution counts from notebooks, so that commits hold only what a person wrote.

    python -m labkit.cli.strip_notebooks                 # every notebooks/*.ipynb
    python -m labkit.cli.strip_notebooks path.ipynb ...  # or the ones named

tests/test_notebooks.py checks that every committed notebook is stripped. Plain JSON, no nbformat
needed; written the way nbformat writes (indent 1, a final newline), so a stripped notebook that
Jupyter saves again shows no spurious diff.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUN_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")
"""Cell metadata that a run (or a front end) writes, not the author."""


def strip(nb: dict) -> bool:
    """Remove outputs, execution counts and run metadata in place; True if anything changed."""
    changed = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            if cell.get("outputs") or cell.get("execution_count") is not None:
                changed = True
            cell["outputs"], cell["execution_count"] = [], None
        meta = cell.get("metadata", {})
        for k in RUN_METADATA:
            if k in meta:
                del meta[k]
                changed = True
    if "widgets" in nb.get("metadata", {}):  # saved widget state: outputs by another name
        del nb["metadata"]["widgets"]
        changed = True
    return changed


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or sorted(Path("notebooks").glob("*.ipynb"))
    for path in paths:
        nb = json.loads(path.read_text())
        if strip(nb):
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            print(f"stripped {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
