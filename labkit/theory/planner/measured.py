"""What the planner needs measured on GPUs and does not have yet, read from one file,
benchmarks/data/planner_measurements.json, that benchmarks/gpu_planner.py fills on a GPU. Each list
starts empty; while it is empty the planner prices as before and says what it assumes instead
(`labkit plan` prints the Hardware's assumptions). Nothing here is fitted: a point is one measured
step or collective, read as it is.

  eager_pace  the elementwise kernels' pace of a stack (their seconds in a profiled step over the
              seconds the model gives them at the roofline: stacks.py `priced`) at one kernel size,
              the step's byte-weighted mean elementwise kernel (stacks.py `kernel_bytes`). With points
              at two sizes or more on one device, a kernel is priced at the pace of its own size,
              log-linear between the points and flat past the ends (`pace`); else one pace for every
              size, the median of the H200's steps (stacks.py).
  fsdp_step   the paces inside a profiled FSDP2 step: its copies around the collectives over their
              bytes at the roofline (`copy_slowdown`; the time model prices them at the roofline until
              measured), its elementwise kernels and optimizer as above.
  nccl        small-message collectives (`seconds` for `bytes` on `gpus` GPUs, `ranks_per_gpu` ranks
              each) and the channels NCCL opened. Only a node's GPUs, one rank each, say what a
              planner's link is: two ranks sharing one GPU (the lent machine) are recorded, not read.

Calibration rows never become validation rows: a point whose model, batch and sequence are one of the
published or measured-here rows the planner is judged on is refused (audit.py `calibration_problems`,
held by tests/test_planner_measured.py; benchmarks/gpu_planner.py refuses to write one).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from functools import cache

from labkit.config import ConfigError
from labkit.theory.presets import PRESETS

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "data", "planner_measurements.json")
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "eager_pace": {
        "device": str,
        "stack": str,
        "model": str,
        "batch": int,
        "seq": int,
        "kernel_bytes": (int, float),
        "memory_slowdown": (int, float),
        "source": str,
    },
    "fsdp_step": {
        "device": str,
        "stack": str,
        "model": str,
        "batch": int,
        "seq": int,
        "world": int,
        "copy_slowdown": (int, float),
        "memory_slowdown": (int, float),
        "optimizer_slowdown": (int, float),
        "source": str,
    },
    "nccl": {
        "device": str,
        "gpus": int,
        "ranks_per_gpu": int,
        "op": str,
        "bytes": int,
        "seconds": (int, float),
        "source": str,
    },
}
"""Each list's rows and the type of each field (benchmarks/gpu_planner.py writes them)."""


def problems(data: dict, name: str, judged: set[tuple] = frozenset()) -> list[str]:
    """What makes `data` not a measurement file: a list missing, a row without a field or of another
    type, a point that is a validation row (`judged`: (model, batch, seq) of the rows the planner is
    judged on, the model by its ModelConfig fields' layers, hidden and vocab)."""
    if not isinstance(data, dict):
        return [f"{name}: a JSON object, not a {type(data).__name__}"]
    out = []
    for key, fields in FIELDS.items():
        rows = data.get(key)
        if not isinstance(rows, list):
            out.append(f"{name}: '{key}' must be a list (empty: not measured)")
            continue
        for i, row in enumerate(rows):
            bad = [f for f, kind in fields.items() if not isinstance(row.get(f), kind) or isinstance(row.get(f), bool)]
            if bad:
                out.append(f"{name}: {key}[{i}] lacks or mistypes {', '.join(bad)}")
            elif key != "nccl" and _shape(row) in judged:
                out.append(
                    f"{name}: {key}[{i}] ({row['model']}, batch {row['batch']}, seq {row['seq']}) is a row the "
                    "planner is judged on (published.py): calibration rows never become validation rows"
                )
    return out


def _shape(row: dict) -> tuple:
    """A point's step as `judged` names the planner's rows: the model's (layers, hidden, vocab), batch, seq."""
    m = PRESETS.get(row["model"])
    if m is None:
        return ()
    return (row.get("layers") or m.layers, m.hidden, m.vocab, row["batch"], row["seq"])


def load(path: str | None = None) -> dict:
    """The file (default PATH, read when called), checked; ConfigError naming it and what is wrong."""
    path = os.path.normpath(path or PATH)
    st = os.stat(path)
    return _load(path, st.st_mtime_ns, st.st_size)  # read again once the file changed (a GPU run filled it)


@cache
def _load(path: str, mtime_ns: int, size: int) -> dict:
    name = os.path.relpath(os.path.normpath(path), os.path.normpath(os.path.join(os.path.dirname(PATH), "..", "..")))
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError([f"{name} is not JSON: {e}"]) from None
    found = problems(data, name)  # the rows judged are audit.py's to add: it sees the published ones
    if found:
        raise ConfigError(found)
    return data


def pace_points(stack: str, path: str | None = None) -> tuple[tuple[float, float], ...]:
    """((kernel_bytes, memory_slowdown), ...) of `stack`, smallest first, from the device with the most
    points; () unless two sizes or more were measured there (one point is one pace: the median's job)."""
    rows = [r for r in load(path)["eager_pace"] if r["stack"] == stack]
    if not rows:
        return ()
    device = max({r["device"] for r in rows}, key=lambda d: sum(r["device"] == d for r in rows))
    points = sorted({(float(r["kernel_bytes"]), float(r["memory_slowdown"])) for r in rows if r["device"] == device})
    return tuple(points) if len({b for b, _ in points}) >= 2 else ()


def pace(points: tuple[tuple[float, float], ...], kernel_bytes: float) -> float:
    """The measured pace at `kernel_bytes`: log-linear in the bytes between two points, the end's pace
    past either end (no extrapolation beyond what was measured)."""
    if kernel_bytes <= points[0][0]:
        return points[0][1]
    for (b0, p0), (b1, p1) in zip(points, points[1:]):
        if kernel_bytes <= b1:
            if b1 == b0:
                return p1
            return p0 + (p1 - p0) * math.log(kernel_bytes / b0) / math.log(b1 / b0)
    return points[-1][1]


def fsdp_paces(stack: str, path: str | None = None) -> dict | None:
    """The median paces inside the measured FSDP steps of `stack` ({'copy_slowdown', 'memory_slowdown',
    'optimizer_slowdown', 'source'}), or None: not measured."""
    rows = [r for r in load(path)["fsdp_step"] if r["stack"] == stack]
    if not rows:
        return None
    out = {k: statistics.median(r[k] for r in rows) for k in ("copy_slowdown", "memory_slowdown", "optimizer_slowdown")}
    return {**out, "source": "; ".join(sorted({r["source"] for r in rows}))}


def nccl_latency(path: str | None = None) -> tuple[float, str] | None:
    """(seconds per ring step of the smallest all-reduce measured on a node's GPUs, one rank each, its
    source), or None: not measured there. A ring all-reduce of n ranks takes 2(n-1) steps."""
    rows = [r for r in load(path)["nccl"] if r["ranks_per_gpu"] == 1 and r["gpus"] >= 2 and r["op"] == "all_reduce"]
    if not rows:
        return None
    row = min(rows, key=lambda r: (r["bytes"], r["seconds"]))
    return row["seconds"] / (2 * (row["gpus"] - 1)), row["source"]


def nccl_channels(path: str | None = None) -> tuple[int, str] | None:
    """(the channels NCCL opened per communicator on a node's GPUs, one rank each, its source), or None."""
    rows = [
        r
        for r in load(path)["nccl"]
        if r["ranks_per_gpu"] == 1 and r["gpus"] >= 2 and isinstance(r.get("channels"), int) and r["channels"] > 0
    ]
    if not rows:
        return None
    return max(r["channels"] for r in rows), rows[0]["source"]
