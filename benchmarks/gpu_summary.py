"""What one scripts/gpu-check.sh run says, item by item, against the GPU targets,
read from the stages' files (a folder, or the results.tgz the script leaves in $OUT).

    python benchmarks/gpu_summary.py gpu-out/results.tgz      # or a folder of the stages' JSONs

A stage that did not run (skipped at the deadline, cut at its limit, a dry run) says 'not run': its
numbers are missing, never filled in.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import xml.etree.ElementTree as ET

TARGETS = {
    "skipped collective": "CollectiveTimeout naming rank 0 and the all-reduce within timeout + 5 s",
    "rank raises": "RankError naming rank 1 within 10 s",
    "lab compiled llama3.2-1b": 0.60,
    "lab compiled gpt2-124m": 0.40,
    "lab over loop": 1.03,
    "ours over torch": 1.02,
    "fp8 over bf16": 1.3,
}
"""The GPU targets: items 2, 5 (MFU on an H100, the Lab within 3% of the plain loop, ours / PyTorch's
<= 1.02 at world 2) and 7 (fp8 tokens/s >= 1.3x bf16's on Llama 3.2 1B)."""


def read(path: str) -> dict[str, object]:
    """name -> parsed content (JSON, or the JUnit XML's root) of every stage file in a folder or a .tgz."""
    blobs: dict[str, bytes] = {}
    if os.path.isdir(path):
        for name in os.listdir(path):
            with open(os.path.join(path, name), "rb") as f:
                blobs[name] = f.read()
    else:
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.isfile():
                    blobs[os.path.basename(m.name)] = tar.extractfile(m).read()
    out: dict[str, object] = {}
    for name, blob in blobs.items():
        try:
            if name.endswith(".json"):
                out[name] = json.loads(blob)
            elif name.endswith(".xml"):
                out[name] = ET.parse(io.BytesIO(blob)).getroot()
        except (json.JSONDecodeError, ET.ParseError):
            out[name] = None  # cut mid-write: said below as not run
    return out


def _ran(doc) -> bool:
    return isinstance(doc, dict) and not doc.get("dry_run")


def lines(got: dict) -> list[str]:
    out = []
    nccl = got.get("nccl.json")
    verdicts = [
        ((r.get("completion") or {}).get("meter_blocking") or {}).get("verdict", "no probe row")
        for t in (nccl or {}).get("tries", [])
        for r in t.get("ranks", [])
    ]
    out.append("1 the log's NCCL end: " + ("; ".join(verdicts) if _ran(nccl) and verdicts else "not run"))
    faults = got.get("faults.json")
    for row in (faults or {}).get("faults", []) + (faults or {}).get("interrupt", []):
        target = TARGETS.get(row["what"], "")
        out.append(
            f"2 {row['what']}: {row['error']} in {row['seconds']} s, as expected {row.get('as_expected')}, next run "
            f"matches {row.get('next_run_matches')}, repair {row.get('repair')}"
            + (f" (target: {target})" if target else "")
        )
    if not _ran(faults):
        out.append("2 faults and interrupts: not run")
    for name in ("pytest.xml", "pytest_gloo.xml"):
        root = got.get(name)
        suite = root if root is None or root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            out.append(f"  pytest -m gpu ({name}): not run")
            continue
        n, bad = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        said = f"{n - bad - skipped} passed, {bad} failed, {skipped} skipped of {n}" if n else "not run (none ran)"
        out.append(f"  pytest -m gpu ({name}): {said}")
    out += _mfu(got)
    ws = got.get("workspace.json")
    out.append(f"3 cuBLAS's workspaces: {ws.get('workspace_bytes')} bytes" if _ran(ws) else "3 workspaces: not run")
    for row in (got.get("memory.json") or {}).get("memory", []):
        out.append(
            f"3 memory {row['precision']}: peak - theory {row.get('peak_above_theory')} B, less the workspaces "
            f"{row.get('peak_above_theory_and_workspaces')} B"
        )
    ep = got.get("ep.json")
    for row in (ep or {}).get("layouts", []):
        out.append(f"4 {row['layout']} {row['precision']}: {'pass' if row['ok'] else 'FAIL'} {row.get('margins')}")
    planner = got.get("planner.json")
    if _ran(planner):
        counts = {k: len(v) for k, v in planner.items() if isinstance(v, list) and k != "parts"}
        errors = {k: v for k, v in planner.items() if k.endswith("_error")}
        out.append(f"6 planner points {counts}" + (f", errors {errors}" if errors else ""))
    else:
        out.append("6 planner measurements: not run")
    fp8 = got.get("fp8.json")
    out.append(f"7 fp8 layouts at world 2: {fp8.get('summary')}" if _ran(fp8) else "7 fp8 layouts: not run")
    return out


def _mfu(got: dict) -> list[str]:
    out = []
    mfu = got.get("mfu.json")
    rows = {(r["what"], r["model"]): r for r in (mfu or {}).get("rows", []) if "step_s" in r}
    for (what, model), r in rows.items():
        target = TARGETS.get(f"{what} {model}")
        out.append(f"5 {what} {model}: MFU {r['mfu']:.1%}" + (f" (target {target:.0%})" if target else ""))
    for model in ("gpt2-124m", "llama3.2-1b"):
        lab, one = rows.get(("lab compiled", model)), rows.get(("one compiled", model))
        if lab and one:
            ratio = lab["step_s"] / one["step_s"]
            out.append(
                f"5 Lab over the plain loop, compiled {model}: {ratio:.3f} (target <= {TARGETS['lab over loop']})"
            )
    if not _ran(mfu):
        out.append("5 compiled MFU: not run")
    for p in (got.get("pairs.json") or {}).get("pairs", []):
        ratio = p.get("ours_over_torch")
        said = f"{ratio:.3f}" if ratio else f"not measured ({p.get('lab_error') or p.get('torch_error')})"
        out.append(f"5 ours / PyTorch's {p['layout']}: {said} (target <= {TARGETS['ours over torch']})")
    llama = {r["what"]: r for r in (got.get("fp8_llama.json") or {}).get("rows", []) if "tokens_per_s" in r}
    if "lab eager" in llama and "lab eager fp8" in llama:
        ratio = llama["lab eager fp8"]["tokens_per_s"] / llama["lab eager"]["tokens_per_s"]
        out.append(f"7 Llama 3.2 1B tokens/s fp8 over bf16: {ratio:.2f} (target >= {TARGETS['fp8 over bf16']})")
    return out


def main() -> None:
    print("\n".join(lines(read(sys.argv[1]))))


if __name__ == "__main__":
    main()
