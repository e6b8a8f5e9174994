"""Every family of strategy at world 2 on one GPU over NCCL (two ranks sharing the card, NCCL >= 2.30),
against the one-process fp32 reference, in fp32 and bf16; and a one-GPU run's memory by category against
the theory, the cuBLAS workspaces measured apart. The faults on NCCL are
benchmarks/gpu_faults.py's.

    python benchmarks/gpu_layouts.py --out layouts.json        # on a machine with a CUDA GPU
    python benchmarks/gpu_layouts.py --layouts ep --only layouts --out ep.json   # some layouts only

Each row: the layout, its precision, whether it trains like one process (labkit.oracle.checks, the CPU
reference and the bounds as they are, never loosened), how close it comes to each bound (error over
bound: `checks.margins`), whether its measured comm rows and model-state bytes equal the theory's
(labkit's own implementations), and seconds. The JSON is rewritten after every row, so a run cut
off by its time limit still says what it reached. The backend is whatever the Lab chose, with its
reason (`Lab.backend_reason`): the check of the NCCL path is only that if the JSON says 'nccl'.

On the arithmetic: the reference runs on the CPU, the ranks on the GPU. TF32 stays off (torch's
default for matmuls, `torch.backends.cuda.matmul.allow_tf32 = False`; the row records it), so fp32
kernels round like fp32 and differ from the CPU's only in the order of their sums: cuBLAS's tiles
and split-K, the attention kernels' online softmax. Two orders of an n-term fp32 sum differ by
~2·sqrt(n)·u (labkit/oracle/bounds.py): the fp32 bound of 1e-5 holds that for n up to ~10^4 terms, far past
these models' b·s = 128 rows and 256-wide contractions. bf16 rounds the same tensors the CPU run
rounds, so its bound (one rounding per tensor on the backward path) is the same derivation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from labkit import Lab, ModelConfig, ParallelConfig, reference, theory
from labkit.engines.host import nccl_version
from labkit.oracle.checks import margins, mismatches

GPT = ModelConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=256, seq=64)
GPT4 = GPT.replace(layers=4)  # pp=2 x v=2: one layer per chunk
LLAMA = ModelConfig(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=64)
MOE = GPT.replace(experts=4, top_k=2)
STATES = ("params", "grads", "optimizer")

LAYOUTS = [
    # data parallel: ours and PyTorch's
    ("ddp", ParallelConfig(dp=2), GPT),
    ("zero1", ParallelConfig(dp=2, sharding="zero1"), GPT),
    ("zero2", ParallelConfig(dp=2, sharding="zero2"), GPT),
    ("zero3", ParallelConfig(dp=2, sharding="zero3"), GPT),
    ("fsdp", ParallelConfig(dp=2, sharding="fsdp"), GPT),
    ("torch ddp", ParallelConfig(dp=2, impl="torch"), GPT),
    ("torch fsdp2", ParallelConfig(dp=2, sharding="fsdp", impl="torch"), GPT),
    # tensor parallel
    ("tp", ParallelConfig(tp=2), GPT),
    ("tp+sp", ParallelConfig(tp=2, sequence_parallel=True), GPT),
    ("tp dtensor", ParallelConfig(tp=2, impl="torch"), GPT),
    ("tp llama gqa", ParallelConfig(tp=2), LLAMA),
    # pipeline
    ("pp gpipe", ParallelConfig(pp=2, microbatches=2, schedule="gpipe"), GPT),
    ("pp 1f1b", ParallelConfig(pp=2, microbatches=4, schedule="1f1b"), GPT),
    ("pp interleaved", ParallelConfig(pp=2, virtual_stages=2, microbatches=4, schedule="interleaved"), GPT4),
    ("pp zbh1", ParallelConfig(pp=2, microbatches=2, schedule="zbh1"), GPT),
    ("torch pp 1f1b", ParallelConfig(pp=2, microbatches=4, schedule="1f1b", impl="torch"), GPT),
    # context and expert parallel
    ("cp ring", ParallelConfig(cp=2), GPT),
    ("cp ring llama", ParallelConfig(cp=2), LLAMA),
    # the other kinds on NCCL: all_gather_into_tensor / reduce_scatter_tensor, and all_to_all_single
    ("cp allgather llama", ParallelConfig(cp=2, cp_kind="allgather"), LLAMA),
    ("cp ulysses llama", ParallelConfig(cp=2, cp_kind="ulysses"), LLAMA),
    ("ep", ParallelConfig(ep=2), MOE),
]
PRECISIONS = ("fp32", "bf16")
DEVICE = "cuda"
"""'cpu' with --cpu: the same script on gloo, to check it before a GPU minute is spent."""


def _ref(cache: dict, model, global_batch: int):
    key = (model, global_batch)
    if key not in cache:
        cache[key] = reference(model, steps=3, global_batch=global_batch)
    return cache[key]


def _theory(res, cfg, model) -> dict:
    """Measured comm rows and model-state bytes against theory.estimate (labkit's own code only:
    PyTorch's DDP, DTensor and pipelining are their implementations')."""
    if cfg.impl == "torch" and not (cfg.sharding == "fsdp" and cfg.tp == cfg.pp == 1):
        return {}
    est = theory.estimate(cfg, model)
    states = all(rk.memory[k] == est.memory[rk.rank][k] for rk in res.ranks for k in STATES)
    out = {"states_equal": states}
    if cfg.impl == "lab" and not (cfg.ep > 1):  # routed all-to-alls depend on the router: tests/theory_match.py
        key = lambda rows: sorted((r["rank"], r["dim"], r["op"], r["calls"], r["payload_bytes"]) for r in rows)
        out["comm_equal"] = key(res.comm_table()) == key(est.comm_table())
    return out


def layouts(lab, out: dict, save, names=None) -> None:
    cache: dict = {}
    for name, cfg, model in LAYOUTS:
        if names and name not in names:
            continue
        for precision in PRECISIONS:
            if precision == "bf16" and cfg.impl == "torch" and cfg.sharding != "fsdp":
                continue  # refused (validation): PyTorch's DDP, DTensor and pipelining keep no fp32 masters
            run_cfg = cfg.replace(precision=precision)
            row = {"layout": name, "precision": precision, "config": run_cfg.to_dict(), "arch": model.arch}
            t0 = time.monotonic()
            try:
                res = lab.run(run_cfg, model=model, steps=3, return_params=True, timeout=60)
                ref = _ref(cache, model, run_cfg.global_batch)
                found = mismatches(res, ref)
                row.update(
                    ok=not found,
                    mismatches=[str(m) for m in found],
                    margins=margins(res, ref),
                    step_ms=[1e3 * t for t in res.ranks[0].step_times],
                    **_theory(res, run_cfg, model),
                )
            except Exception as e:  # noqa: BLE001 - a row records what failed and the next one runs
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            row["seconds"] = round(time.monotonic() - t0, 2)
            print(
                f"{name:<16} {precision}  {'ok ' if row['ok'] else 'FAIL'}  {row['seconds']:5.1f} s  "
                + json.dumps(row.get("margins") or row.get("error") or row.get("mismatches"))[:300],
                flush=True,
            )
            out["layouts"].append(row)
            save()


def workspaces(path: str | None) -> tuple[int | None, str]:
    """cuBLAS's workspaces on this device (benchmarks/gpu_workspace.py): from `path` (this run's
    measurement), else the kept one the theory reads (calibration.load_workspace); None: not measured."""
    if path:
        with open(path) as f:
            got = json.load(f).get("workspace_bytes")
        return got, path
    from gpu_mfu import hardware_of_device

    from labkit.theory.planner.calibration import load_workspace

    kept = load_workspace(hardware_of_device(torch.cuda.get_device_name())) if DEVICE == "cuda" else None
    return (kept[0], kept[1]) if kept else (None, "not measured")


def memory(out: dict, save, workspace: str | None = None) -> None:
    """A one-GPU, one-rank run (NCCL world of one): model states exact, activations and the
    allocator's peak beside the theory's, and beside the theory's plus cuBLAS's measured workspaces."""
    ws, ws_source = workspaces(workspace)
    model = ModelConfig(arch="gpt2", layers=4, hidden=256, heads=4, ffn=1024, vocab=4096, seq=256)
    for precision in PRECISIONS:
        cfg = ParallelConfig(global_batch=8, precision=precision)
        with Lab(engines=1, device=DEVICE, progress=False, timeout=120) as one:
            res = one.run(cfg, model=model, steps=2)
            backend = one.backend
        est = theory.estimate(cfg, model).memory[0]
        got = res.ranks[0].memory
        row = {"precision": precision, "backend": backend, "measured": got, "theory": est}
        row["states_equal"] = all(got[k] == est[k] for k in STATES)
        row["activations_ratio"] = got["activations"] / est["activations"] if est["activations"] else None
        row["peak_over_theory"] = got["peak"] / est["peak"] if est["peak"] else None
        row["peak_above_theory"] = got["peak"] - est["peak"]
        row["workspace_bytes"], row["workspace_source"] = ws, ws_source
        row["peak_above_theory_and_workspaces"] = None if ws is None else got["peak"] - est["peak"] - ws
        print(f"memory {precision}: {json.dumps(row)[:600]}", flush=True)
        out["memory"].append(row)
        save()


def guarded(part: str, fn, out: dict, save) -> None:
    """Run one part; a failure is recorded and the next part runs."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        out[f"{part}_error"] = traceback.format_exc()[-3000:]
        print(out[f"{part}_error"], flush=True)
        save()


def main() -> None:
    global DEVICE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="layouts.json")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=["layouts", "memory"], choices=["layouts", "memory"])
    ap.add_argument("--layouts", nargs="*", default=None, choices=[n for n, _, _ in LAYOUTS], help="these only")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks the script runs")
    ap.add_argument("--backend", default="auto", help="the Lab's backend (gloo where NCCL cannot share the GPU)")
    ap.add_argument("--workspace", default=None, help="this run's benchmarks/gpu_workspace.py JSON, for memory")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    if ns.dry_run:
        with open(ns.out, "w") as f:
            json.dump({"dry_run": True, "parts": ns.only, "layouts": [], "memory": []}, f)
        return
    if ns.cpu:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu)")
    gpu = DEVICE == "cuda"
    out = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl_in_this_process": ".".join(map(str, nccl_version() or ())) if gpu else "",
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "layouts": [],
        "memory": [],
    }

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    t0 = time.monotonic()
    if "layouts" in ns.only:
        with Lab(engines=ns.engines, device=DEVICE, backend=ns.backend, progress=False, timeout=120) as lab:
            out.update(backend=lab.backend, backend_reason=lab.backend_reason, devices=lab.devices)
            out["start_seconds"] = round(time.monotonic() - t0, 1)
            print(f"Lab: {lab.backend} on {lab.devices} ({lab.backend_reason}) in {out['start_seconds']} s", flush=True)
            save()
            guarded("layouts", lambda: layouts(lab, out, save, ns.layouts), out, save)
    if "memory" in ns.only:
        guarded("memory", lambda: memory(out, save, ns.workspace), out, save)
    rows = out["layouts"]
    out["summary"] = {
        "layouts_ok": sum(r["ok"] for r in rows),
        "layouts": len(rows),
        "failed": [f"{r['layout']} {r['precision']}" for r in rows if not r["ok"]],
        "seconds": round(time.monotonic() - t0, 1),
    }
    save()
    print(json.dumps(out["summary"]), flush=True)


if __name__ == "__main__":
    main()
