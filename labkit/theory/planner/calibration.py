"""The hardware measurements the planner's constants come from: one schema and one loader for
benchmarks/gpu_constants_<device>.json (written by benchmarks/gpu_constants.py on a GPU), and the
rules that turn a file into a Hardware's efficiencies. Calibration stays apart from validation: a
constant is read from these files or from a cited datasheet, never from a row the model is judged
on (theory/planner/audit.py); one with neither is listed in its Hardware's `assumptions`, which
`labkit plan` prints.

The rules (each a statistic over the file's rows, no rounding, no hand-picked row):
  matmul_eff       median bf16 rate of the products with every dim >= 4096 (the shapes of a Llama
                   block and head at the planner's scale) over the datasheet's dense bf16 peak
  fp8_matmul_eff   the same for the fp8 products (torch._scaled_mm) over the dense fp8 peak
  attention_eff    median forward + backward rate of causal attention at head dim 128 over 8192
                   keys or more, over the bf16 peak
  attention shape  the rate lost per halving of the keys below 8192 (from the 2048-key rows) and
                   head dim 64's rate over head dim 128's (hardware.attention_shape)
  hbm_eff          the mean of the copy and add bandwidths over the datasheet's HBM bandwidth
  memory, context  the device's reported total, and what the CUDA context and cuBLAS take
  allocator        mean reserved / allocated peak - 1 over the Llama steps of the CALIBRATION file
                   (the allocator is PyTorch's, not the device's: the H200's steps calibrate it, so
                   the H100's own steps stay validation rows in benchmarks/published.py)
  workspaces       cuBLAS's workspaces held in the allocator through a step, as measured on the device
                   (benchmarks/gpu_workspace_<device>.json, `load_workspace`); no file: not measured, no term

The files are read from the repository's benchmarks/ (labkit is installed editable from its
checkout, as README and binder/postBuild install it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass

from labkit.config import ConfigError

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks")
SCHEMA: dict[str, type | tuple[type, ...]] = {
    "device": str,
    "date": str,
    "torch": str,
    "cuda": str,
    "driver": str,
    "total_bytes": int,
    "context_bytes": int,
    "matmul": list,
    "attention": list,
    "bandwidth": dict,
    "llama": list,
}
"""Every field a measurement file must have, and its type (benchmarks/gpu_constants.py writes them;
'nccl' and notes are optional)."""
ROWS = {
    "matmul": ("M", "K", "N", "bf16_tflops", "fp8_tflops"),
    "attention": ("b", "heads", "kv_heads", "s", "hd", "fwd_bwd_tflops"),
    "llama": ("ac", "step_s", "allocated_peak", "reserved_peak"),
}
"""The keys each row of a list field must have."""


def problems(data: dict, name: str = "the file") -> list[str]:
    """What makes `data` not a measurement file: a missing field, a field of another type, a row
    without its keys; empty when it is one."""
    if not isinstance(data, dict):
        return [f"{name}: a measurement file is a JSON object, not a {type(data).__name__}"]
    out = []
    for key, kind in SCHEMA.items():
        if key not in data:
            out.append(f"{name}: '{key}' is missing ({kind.__name__}); benchmarks/gpu_constants.py writes it")
        elif not isinstance(data[key], kind) or isinstance(data[key], bool):
            out.append(f"{name}: '{key}'={data[key]!r} must be a {kind.__name__}")
    for key, needed in ROWS.items():
        for i, row in enumerate(data.get(key) or []):
            lacking = [k for k in needed if not isinstance(row, dict) or k not in row]
            if lacking:
                out.append(f"{name}: {key}[{i}] lacks {', '.join(lacking)}")
    bandwidth = data.get("bandwidth")
    if isinstance(bandwidth, dict) and not {"copy_TBps", "add_TBps"} <= set(bandwidth):
        out.append(f"{name}: 'bandwidth' needs copy_TBps and add_TBps")
    return out


@dataclass(frozen=True)
class Measurement:
    """One measurement file, checked against SCHEMA."""

    path: str
    data: dict

    @property
    def provenance(self) -> str:
        d = self.data
        return f"{d['device']}, torch {d['torch']}, CUDA {d['cuda']}, driver {d['driver']}, {d['date']}"

    def matmul_rate(self, precision: str) -> float:
        """Median FLOP/s of the products with every dim >= 4096 (`precision`: 'bf16' or 'fp8')."""
        large = [m for m in self.data["matmul"] if min(m["M"], m["K"], m["N"]) >= 4096]
        return statistics.median(m[f"{precision}_tflops"] for m in large) * 1e12

    def attention_rate(self) -> float:
        """Median forward + backward FLOP/s of causal attention, head dim 128, 8192 keys or more."""
        long = [a for a in self.data["attention"] if a["hd"] == 128 and a["s"] >= 8192]
        return statistics.median(a["fwd_bwd_tflops"] for a in long) * 1e12

    def attention_shape(self) -> tuple[float, float]:
        """(the rate lost per halving of the keys below 8192, head dim 64's rate over head dim 128's
        at the same keys): from the head-dim-128 rows at 2048 keys (two halvings) and the head-dim-64
        rows, each over attention_rate (hardware.attention_shape prices blocks with them)."""
        long = self.attention_rate() / 1e12
        rows = self.data["attention"]
        short = statistics.median(a["fwd_bwd_tflops"] for a in rows if a["hd"] == 128 and a["s"] == 2048)
        halving = (1 - short / long) / 2
        # head dim 64 over head dim 128 at the same keys, the latter on the log-linear line
        narrow = [a["fwd_bwd_tflops"] / long / (1 - halving * max(0.0, math.log2(8192 / a["s"]))) for a in rows]
        narrow = [x for x, a in zip(narrow, rows) if a["hd"] == 64]
        return halving, statistics.median(narrow)

    def hbm_rate(self) -> float:
        """Bytes/s of an elementwise kernel: the mean of copy and add."""
        bw = self.data["bandwidth"]
        return (bw["copy_TBps"] + bw["add_TBps"]) / 2 * 1e12

    def allocator(self) -> float:
        """Mean reserved / allocated peak - 1 over the file's Llama steps."""
        steps = self.data["llama"]
        return statistics.mean(s["reserved_peak"] / s["allocated_peak"] for s in steps) - 1


def path_of(device: str) -> str:
    return os.path.normpath(os.path.join(BENCHMARKS, f"gpu_constants_{device}.json"))


def load(device: str) -> Measurement:
    """benchmarks/gpu_constants_<device>.json, checked; ConfigError naming the file and what is wrong."""
    path = path_of(device)
    name = os.path.relpath(path, os.path.join(BENCHMARKS, ".."))
    if not os.path.exists(path):
        raise ConfigError([f"{name} does not exist: run benchmarks/gpu_constants.py on a {device} and keep its JSON"])
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError([f"{name} is not JSON: {e}"]) from None
    found = problems(data, name)
    if found:
        raise ConfigError(found)
    return Measurement(name, data)


def efficiencies(m: Measurement, flops: float, fp8_flops: float, hbm: float, allocator: Measurement) -> dict:
    """The Hardware fields the rules above derive from `m` against the datasheet's peaks."""
    return dict(
        memory=float(m.data["total_bytes"]),
        context=float(m.data["context_bytes"]),
        matmul_eff=m.matmul_rate("bf16") / flops,
        fp8_matmul_eff=m.matmul_rate("fp8") / fp8_flops,
        attention_eff=m.attention_rate() / flops,
        hbm_eff=m.hbm_rate() / hbm,
        allocator=allocator.allocator(),
    )


KERNELS = os.path.join(BENCHMARKS, "data", "gpu-h200-2026-11-26", "mfu.json")
"""benchmarks/gpu_mfu.py's measurement on the H200: one-process training steps, eager and
compiled, with each step's kernel seconds by kind from the profiler (matmul, attention, optimizer,
other): what theory/planner/stacks.py prices each software stack from."""
KERNEL_KINDS = ("matmul", "attention", "optimizer", "other")


def load_kernels(path: str = KERNELS) -> list[dict]:
    """The rows of a kernel measurement that carry kernel seconds, each checked (device, torch and
    CUDA named at the top); ConfigError naming the file and what is wrong."""
    name = os.path.relpath(os.path.normpath(path), os.path.normpath(os.path.join(BENCHMARKS, "..")))
    with open(path) as f:
        data = json.load(f)
    found = [f"{name}: '{k}' is missing" for k in ("device", "torch", "cuda", "rows") if k not in data]
    rows = [r for r in data.get("rows", []) if "kernels" in r]
    for i, r in enumerate(rows):
        lacking = [k for k in ("what", "model", "batch", "seq") if k not in r]
        lacking += [k for k in KERNEL_KINDS if k not in r["kernels"].get("kernel_s", {})]
        if lacking:
            found.append(f"{name}: row {i} ({r.get('what')}) lacks {', '.join(lacking)}")
    if found or not rows:
        raise ConfigError(found or [f"{name}: no row with kernel seconds"])
    return [dict(r, source=f"{name} ({data['device']}, torch {data['torch']}, CUDA {data['cuda']})") for r in rows]


WORKSPACE_FIELDS: dict[str, type] = {"device": str, "date": str, "torch": str, "cuda": str, "workspace_bytes": int}
"""What benchmarks/gpu_workspace.py writes and the theory reads (`load_workspace`)."""


def workspace_path(device: str) -> str:
    return os.path.normpath(os.path.join(BENCHMARKS, f"gpu_workspace_{device}.json"))


def load_workspace(device: str) -> tuple[int, str] | None:
    """(bytes, provenance) of cuBLAS's workspaces in PyTorch's allocator during a training step on
    `device` (benchmarks/gpu_workspace_<device>.json: what torch._C._cuda_clearCublasWorkspaces frees
    after a step; benchmarks/gpu_workspace.py), or None where the file does not exist: not measured,
    and no number stands in for it. ConfigError naming the file for one that is not a measurement (a
    dry run's frame included: it has no workspace_bytes)."""
    path = workspace_path(device)
    if not os.path.exists(path):
        return None
    name = os.path.relpath(path, os.path.join(BENCHMARKS, ".."))
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError([f"{name} is not JSON: {e}"]) from None
    found = [
        f"{name}: '{k}' must be a {kind.__name__} (benchmarks/gpu_workspace.py writes it on a GPU)"
        for k, kind in WORKSPACE_FIELDS.items()
        if not isinstance(data.get(k), kind) or isinstance(data.get(k), bool)
    ]
    if found:
        raise ConfigError(found)
    return data[
        "workspace_bytes"
    ], f"{name} ({data['device']}, torch {data['torch']}, CUDA {data['cuda']}, {data['date']})"
