"""Every family of strategy at world 2 on one GPU over NCCL (two ranks sharing the card, NCCL >= 2.30),
against the one-process fp32 reference, in fp32 and bf16; the faults on NCCL; and a one-GPU run's
memory by category against the theory (issue 33).

    python benchmarks/gpu_layouts.py --out layouts.json        # on a machine with a CUDA GPU

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
import os
import signal
import sys
import threading
import time
import traceback

import torch

from labkit import CollectiveTimeout, EngineDied, Lab, ModelConfig, ParallelConfig, RankError, reference, theory
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
HANG_TIMEOUT = 15.0
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


def layouts(lab, out: dict, save) -> None:
    cache: dict = {}
    for name, cfg, model in LAYOUTS:
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


# -- faults on NCCL, shipped to the engines by value ------------------------------------------
def _skip_collective():
    import torch
    import torch.distributed as dist

    t = torch.ones(8, device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.get_rank() != 1:  # rank 1 skips the all-reduce
        dist.all_reduce(t)
    return float(t[0])  # float() waits for the GPU


def _rank_raises():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    t = torch.ones(8, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t)
    return float(t[0])  # float() waits for the GPU


def _all_reduce_forever():
    import time as _time

    import torch
    import torch.distributed as dist

    t = torch.ones(8, device="cuda" if torch.cuda.is_available() else "cpu")
    end = _time.monotonic() + 60
    while _time.monotonic() < end:
        dist.all_reduce(t)
        float(t[0])
        _time.sleep(0.02)


def _pid():
    return os.getpid()


def faults(lab, out: dict, save) -> None:
    ref = reference(GPT, steps=2, global_batch=8)

    def after() -> bool:  # the next layout runs and trains like one process
        res = lab.run(ParallelConfig(dp=2), model=GPT, steps=2, return_params=True, timeout=60)
        return not mismatches(res, ref)

    def attempt(name, fn, check):
        t0 = time.monotonic()
        try:
            fn()
            err = None
        except BaseException as e:  # noqa: BLE001 - the row inspects it
            err = e
        took = time.monotonic() - t0
        row = {"fault": name, "error": type(err).__name__, "seconds": round(took, 2), "message": str(err)[:1500]}
        try:
            row["as_expected"] = bool(check(err, took))
            t1 = time.monotonic()
            row["next_run_matches"] = after()
            row["next_run_seconds"] = round(time.monotonic() - t1, 2)
        except Exception as e:  # noqa: BLE001
            row["after_error"] = f"{type(e).__name__}: {e}"[:1500]
        print(f"fault {name}: {json.dumps(row)[:400]}", flush=True)
        out["faults"].append(row)
        save()

    attempt(
        "skipped collective",
        lambda: lab.apply(_skip_collective, timeout=HANG_TIMEOUT),
        lambda e, took: (
            isinstance(e, CollectiveTimeout)
            and took < HANG_TIMEOUT + 5
            and "rank 0 (" in str(e)
            and "entered and never left all_reduce" in str(e)  # the diagnosis sees where rank 0 waits
        ),
    )
    attempt(
        "rank raises",
        lambda: lab.apply(_rank_raises, timeout=30),
        lambda e, took: isinstance(e, RankError) and set(e.failures) == {1} and took < 10,
    )
    victim = lab.engines.pids[1]

    def kill():
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    attempt(
        "killed engine",
        lambda: lab.apply(_all_reduce_forever, timeout=30),
        lambda e, took: isinstance(e, EngineDied) and e.rank == 1,
    )
    out["faults"][-1]["replaced"] = lab.engines.pids[1] != victim and lab.apply(_pid) == lab.engines.pids
    save()


def memory(out: dict, save) -> None:
    """A one-GPU, one-rank run (NCCL world of one): model states exact, activations and the
    allocator's peak beside the theory's."""
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
    ap.add_argument("--only", nargs="*", default=["layouts", "faults", "memory"])
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks the script runs")
    ap.add_argument("--backend", default="auto", help="the Lab's backend (gloo where NCCL cannot share the GPU)")
    ns = ap.parse_args()
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
        "faults": [],
        "memory": [],
    }

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    t0 = time.monotonic()
    with Lab(engines=ns.engines, device=DEVICE, backend=ns.backend, progress=False, timeout=120) as lab:
        out.update(backend=lab.backend, backend_reason=lab.backend_reason, devices=lab.devices)
        out["start_seconds"] = round(time.monotonic() - t0, 1)
        print(f"Lab: {lab.backend} on {lab.devices} ({lab.backend_reason}) in {out['start_seconds']} s", flush=True)
        save()
        if "layouts" in ns.only:
            guarded("layouts", lambda: layouts(lab, out, save), out, save)
    # memory before the faults: on NCCL each fault's release and repair take 15-35 s (H200, 2026-11-26)
    if "memory" in ns.only:
        guarded("memory", lambda: memory(out, save), out, save)
    if "faults" in ns.only:
        with Lab(engines=ns.engines, device=DEVICE, backend=ns.backend, progress=False, timeout=120) as lab:
            guarded("faults", lambda: faults(lab, out, save), out, save)
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
