"""The faults and the interrupts on NCCL at world 2 (two ranks sharing one GPU): the GPU script's second item and
the stop on a GPU. Each fault is timed, checked against what it should become, and followed by
the next layout, which must train like one process; the Lab's repairs are recorded beside.

    python benchmarks/gpu_faults.py --out faults.json [--only faults interrupt]   # on a CUDA GPU
    python benchmarks/gpu_faults.py --cpu --out faults.json                       # the same on gloo, CPU
    python benchmarks/gpu_faults.py --dry-run --out faults.json                   # arguments and file only

  faults     a skipped all-reduce: CollectiveTimeout within timeout + 5 s naming rank 0 and the
             all-reduce it waits in (the collective log's NCCL end, item 1, and the abort of the
             live ranks' communicators, item 2); a raising rank: RankError naming rank 1 within 10 s;
             a killed engine: EngineDied naming rank 1, replaced
  interrupt  Lab.cancel() from another thread and a Ctrl-C, under DDP and a 1F1B pipeline: the ranks
             stop together at a step boundary (engines/runtime.py `stop_agreed`), so the next run keeps
             the process groups (no repair) and trains like one process

The JSON is rewritten after every row.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import signal
import sys
import threading
import time

from gpu_layouts import GPT

HANG_TIMEOUT = 15.0
"""The Lab's timeout for the skipped all-reduce: the H200 and H100 runs of 2026-11-26 used 15 s."""
WITHIN_S = 5.0
"""The bound past the timeout for the CollectiveTimeout; and for a RankError or a stop, 10 s
(twice it: the H200's gloo RankError took 0.9 s, NCCL's 20.6 s before the abort)."""
PARTS = ("faults", "interrupt")


# -- faults, shipped to the engines by value ---------------------------------------------------
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


def _next_run(lab, row: dict, ref) -> None:
    """The next layout after a fault: whether it trains like one process, its seconds, and the
    repair it needed (engines replaced, seconds), if any."""
    from labkit import ParallelConfig
    from labkit.oracle.checks import mismatches

    before = len(lab.repairs)
    t1 = time.monotonic()
    res = lab.run(ParallelConfig(dp=2), model=GPT, steps=2, return_params=True, timeout=60)
    row["next_run_matches"] = not mismatches(res, ref)
    row["next_run_seconds"] = round(time.monotonic() - t1, 2)
    row["repair"] = lab.repairs[-1] if len(lab.repairs) > before else None


def _row(name: str, err: BaseException | None, took: float) -> dict:
    return {"what": name, "error": type(err).__name__, "seconds": round(took, 2), "message": str(err)[:1500]}


def _timed(fn) -> tuple[BaseException | None, float]:
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the row inspects it
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


def faults(lab, out: dict, save, ref) -> None:
    from labkit import CollectiveTimeout, EngineDied, RankError

    def attempt(name, fn, check):
        err, took = _timed(fn)
        row = _row(name, err, took)
        try:
            row["as_expected"] = bool(check(err, took))
            _next_run(lab, row, ref)
        except Exception as e:  # noqa: BLE001 - recorded, the next fault runs
            row["after_error"] = f"{type(e).__name__}: {e}"[:1500]
        print(f"fault {name}: {json.dumps(row)[:600]}", flush=True)
        out["faults"].append(row)
        save()

    attempt(
        "skipped collective",
        lambda: lab.apply(_skip_collective, timeout=HANG_TIMEOUT),
        lambda e, took: (
            isinstance(e, CollectiveTimeout)
            and took < HANG_TIMEOUT + WITHIN_S
            and "rank 0 (" in str(e)
            and "entered and never left all_reduce" in str(e)  # the diagnosis sees where rank 0 waits
        ),
    )
    attempt(
        "rank raises",
        lambda: lab.apply(_rank_raises, timeout=30),
        lambda e, took: isinstance(e, RankError) and set(e.failures) == {1} and took < 2 * WITHIN_S,
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


def interrupts(lab, out: dict, save, ref) -> None:
    """Cancel and Ctrl-C half a second after the first step's progress record, under DDP and 1F1B."""
    from labkit import ParallelConfig

    layouts = {"dp2": ParallelConfig(dp=2), "pp2 1f1b": ParallelConfig(pp=2, microbatches=4, schedule="1f1b")}
    for name, cfg in layouts.items():
        for how in ("cancel", "ctrl-c"):
            row = _interrupted(lab, cfg, how, name)
            try:
                _next_run(lab, row, ref)
                row["groups_kept"] = row["repair"] is None  # stopped in step: nothing to rebuild
            except Exception as e:  # noqa: BLE001 - recorded, the next case runs
                row["after_error"] = f"{type(e).__name__}: {e}"[:1500]
            print(f"interrupt {how} {name}: {json.dumps(row)[:600]}", flush=True)
            out["interrupt"].append(row)
            save()


def _interrupted(lab, cfg, how: str, name: str) -> dict:
    """One long run stopped by `how` ('cancel' from another thread, or 'ctrl-c' in this one)."""
    from labkit import Cancelled

    sent, first = {}, threading.Event()

    def stop():
        sent["at"] = time.monotonic()
        lab.cancel() if how == "cancel" else _thread.interrupt_main()

    def on_progress(rec):
        if not first.is_set():
            first.set()
            threading.Timer(0.5, stop).start()

    err, _ = _timed(lambda: lab.run(cfg, model=GPT, steps=100000, timeout=120, progress=on_progress))
    took = time.monotonic() - sent["at"] if "at" in sent else float("nan")
    row = _row(f"{how} {name}", err, took)
    row["stopped_everywhere"] = "running" not in lab.engine_states()
    want = Cancelled if how == "cancel" else KeyboardInterrupt
    row["as_expected"] = isinstance(err, want) and took < 2 * WITHIN_S and row["stopped_everywhere"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="faults.json")
    ap.add_argument("--only", nargs="*", default=list(PARTS), choices=PARTS)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks the script runs")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    out: dict = {"parts": ns.only, "faults": [], "interrupt": []}
    # a Ctrl-C handled as a notebook's kernel does: a stage started in the background inherits SIGINT
    # ignored, where `_thread.interrupt_main` does nothing (tests/test_faults.py `ctrl_c`)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    if ns.dry_run:
        out["dry_run"] = True
        return save()
    import torch

    from labkit import Lab, reference
    from labkit.engines.host import nccl_version

    if not ns.cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu)")
    device = "cpu" if ns.cpu else "cuda"
    out["nccl"] = ".".join(map(str, nccl_version() or ())) if device == "cuda" else ""
    ref = reference(GPT, steps=2, global_batch=8)
    t0 = time.monotonic()
    with Lab(engines=2, device=device, progress=False, timeout=120) as lab:
        out.update(
            backend=lab.backend, backend_reason=lab.backend_reason, start_seconds=round(time.monotonic() - t0, 1)
        )
        save()
        for part, fn in (("faults", faults), ("interrupt", interrupts)):
            if part in ns.only:
                try:
                    fn(lab, out, save, ref)
                except Exception as e:  # noqa: BLE001 - recorded, the next part runs
                    out[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
                    save()
    rows = out["faults"] + out["interrupt"]
    out["summary"] = {"as_expected": sum(bool(r.get("as_expected")) for r in rows), "rows": len(rows)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    save()
    print(json.dumps(out["summary"]), flush=True)


if __name__ == "__main__":
    main()
