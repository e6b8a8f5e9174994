"""Two NCCL ranks on one GPU, without labkit: does this NCCL run them, with which settings, and what
do its collectives and point-to-point cost there.

    python benchmarks/nccl_shared.py --out nccl.json [--ranks 2]    # on a machine with one CUDA GPU

Tries the settings in SETTINGS in order, each in fresh processes bounded by a timeout (NCCL's
docs: 'it may exhaust resources and lock NCCL'), and stops at the first that passes every op; the
refusal without the flag is recorded too (NCCL >= 2.30: 'Multiple Ranks are using the same
GPU/Partition'; older: 'Duplicate GPU detected'). It prints `export NAME=VALUE` lines of the
settings that worked, which scripts/gpu-check.sh hands to the Lab (the notebook's NCCL_*
variables are forwarded to the engines and win over labkit's defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = [
    ("no flag (expect a refusal)", {}),
    ("flag, 4 CTAs (labkit's default)", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "4"}),
    ("flag, 2 CTAs, GDR local", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2", "NCCL_NET_GDR_LEVEL": "LOC"}),
    (
        "flag, 2 CTAs, no P2P (through host memory)",
        {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2", "NCCL_P2P_DISABLE": "1"},
    ),
    (
        "flag, 2 CTAs, no P2P, no SHM",
        {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
    ),
]


def worker(rank: int, world: int, port: int) -> dict:
    """One rank: every op labkit's strategies use, checked, and a 64 MiB all-reduce timed."""
    import datetime

    import torch
    import torch.distributed as dist

    from labkit.engines.host import nccl_version

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=dev)
    got = {"init_s": time.perf_counter() - t0, "nccl": ".".join(map(str, nccl_version() or ()))}
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    ok = {"all_reduce": bool((x == world * (world + 1) / 2).all())}
    out = torch.empty(world << 10, device=dev)
    dist.all_gather_into_tensor(out, torch.full((1 << 10,), float(rank), device=dev))
    ok["all_gather"] = bool((out.view(world, -1)[:, 0] == torch.arange(world, device=dev)).all())
    rs = torch.empty(1 << 10, device=dev)
    dist.reduce_scatter_tensor(rs, torch.ones(world << 10, device=dev))
    ok["reduce_scatter"] = bool((rs == world).all())
    a2a = torch.empty(world * 4, device=dev)
    dist.all_to_all_single(a2a, torch.arange(world * 4, device=dev, dtype=torch.float32) + 100 * rank)
    ok["all_to_all"] = bool(a2a.view(world, 4)[:, 0].tolist() == [100 * r + 4 * rank for r in range(world)])
    b = torch.full((8,), float(rank), device=dev)
    dist.broadcast(b, 0)
    ok["broadcast"] = bool((b == 0).all())
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    send, recv = torch.full((1 << 16,), float(rank), device=dev), torch.empty(1 << 16, device=dev)
    ops = [dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ok["batched p2p ring"] = bool((recv == prv).all())
    try:  # a diagnosis: its failure must not hide the ops' result above
        got["completion"] = completion_probe(rank, world, dev)
    except Exception as e:
        got["completion"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    big = torch.ones(16 << 20, device=dev)  # 64 MiB
    for _ in range(3):
        dist.all_reduce(big)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dist.all_reduce(big)
    end.record()
    torch.cuda.synchronize()
    sec = start.elapsed_time(end) / 1e3 / 10
    # the ring model's bus bandwidth (nccl-tests' busbw): 2(n-1)/n bytes per byte reduced
    got.update(ok=ok, all_reduce_64mib_ms=sec * 1e3, busbw_gbs=2 * (world - 1) / world * big.numel() * 4 / sec / 1e9)
    dist.barrier()
    dist.destroy_process_group()
    return got


def _poll(work, t0: float, limit: float = 4.0) -> float | None:
    """Seconds after t0 at which work.is_completed() first said True (None: not within limit)."""
    while time.perf_counter() - t0 < limit:
        if work.is_completed():
            return round(time.perf_counter() - t0, 3)
        time.sleep(0.01)
    return None


def completion_probe(rank: int, world: int, dev) -> dict:
    """When does an NCCL Work say it is completed, against when the GPU finished it? (a question the CPU cannot answer:
    labkit's collective log stamped an all-reduce's end while a ~1 s kernel was still ahead of it
    at world 2, not at world 1). Three cases, each timed from the enqueue:
      gpu_busy: a ~0.5 s sleep kernel on the current stream, then all_reduce(async_op=True)
      peer_late: rank 0 enters at once, the others 1 s later (host sleep), no kernel ahead
      meter_blocking: the sleep kernel, then a blocking all_reduce under labkit's collective log
    and what Work.is_completed / the future / an event recorded after it say. (A case that patched
    ProcessGroup.allreduce to hold a blocking call's Work saw none on the H100, 2026-11-26: the
    Python call does not go through that attribute; the log's own path replaced it.)"""
    import torch
    import torch.distributed as dist

    out = {}
    x = torch.ones(1 << 20, device=dev)
    dist.barrier()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    t0 = time.perf_counter()
    w = dist.all_reduce(x, async_op=True)
    enq = time.perf_counter() - t0
    ev = torch.cuda.Event()
    ev.record()
    first = {"is_completed": w.is_completed(), "future_done": w.get_future().done(), "event_done": ev.query()}
    seen = _poll(w, t0)
    torch.cuda.synchronize()
    out["gpu_busy"] = {
        "enqueue_s": round(enq, 4),
        "at_enqueue": first,
        "completed_s": seen,
        "gpu_done_s": round(time.perf_counter() - t0, 3),
    }
    dist.barrier()
    torch.cuda.synchronize()
    if rank != 0:
        time.sleep(1.0)
    t0 = time.perf_counter()
    w = dist.all_reduce(x, async_op=True)
    first = {"is_completed": w.is_completed(), "future_done": w.get_future().done()}
    seen = _poll(w, t0)
    torch.cuda.synchronize()
    out["peer_late"] = {"at_enqueue": first, "completed_s": seen, "gpu_done_s": round(time.perf_counter() - t0, 3)}
    dist.barrier()
    torch.cuda.synchronize()
    out["meter_blocking"] = _meter_probe(x)
    dist.barrier()
    return out


POLL_S = 0.01
"""How often the probe below looks at the log and at the GPU."""


def _meter_probe(x) -> dict:
    """labkit's collective log on a blocking all-reduce queued behind a ~0.5 s GPU sleep: when does
    its event get an end, against when the GPU ran the all-reduce (an event recorded after it, polled
    in the same loop)? The log's StreamMark (engines/meters/stream_mark.py) should stamp it then, not
    at the call's return (2026-11-26, H100: stamped at once). `meter_verdict` reads the row."""
    import torch
    import torch.distributed as dist

    from labkit.engines.meters.comm import CommMeter

    torch.cuda.synchronize()
    with CommMeter({}) as meter:
        torch.cuda._sleep(1_000_000_000)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        ret = time.perf_counter() - t0
        done = torch.cuda.Event()
        done.record()
        meter.sweep()
        ev = meter.events[-1]
        row = {"return_s": round(ret, 4), "op": ev["op"], "end_at_return": ev["end"] is not None}
        gpu = None
        while (ev["end"] is None or gpu is None) and time.perf_counter() - t0 < 4:
            meter.sweep()
            if gpu is None and done.query():
                gpu = time.perf_counter() - t0
            time.sleep(POLL_S)
        row["end_s"] = None if ev["end"] is None else round(ev["end"] - ev["start"], 4)
        row["end_after_t0_s"] = None if ev["end"] is None else round(ev["end"] - t0, 4)
        row["gpu_ran_s"] = None if gpu is None else round(gpu, 4)
        torch.cuda.synchronize()
        row["gpu_done_s"] = round(time.perf_counter() - t0, 3)
    row["verdict"] = meter_verdict(row)
    return row


def meter_verdict(row: dict) -> str:
    """'PASS ...' when the log left the blocking all-reduce once the GPU had run it (not at the call's
    return, no sooner than the GPU's own event said so, less two polls), else 'FAIL ...' with why."""
    if row.get("end_at_return"):
        return f"FAIL: the log stamped the all-reduce's end at the call's return ({row['return_s']} s), GPU still busy"
    if row.get("end_after_t0_s") is None:
        return f"FAIL: the log never stamped the all-reduce's end (GPU ran it at {row.get('gpu_ran_s')} s)"
    if row.get("gpu_ran_s") is None:
        return "FAIL: the GPU's own event after the all-reduce never completed within the probe's 4 s"
    # the loop looks at the log, then at the event: the log's end can trail or lead the event by a poll each
    early = row["gpu_ran_s"] - row["end_after_t0_s"]
    if early > 2 * POLL_S:
        return f"FAIL: the log's end ({row['end_after_t0_s']} s) came {early:.3f} s before the GPU ran the op"
    end, ran = row["end_after_t0_s"], row["gpu_ran_s"]
    return f"PASS: the log's end {end} s, the GPU ran it at {ran} s (the call returned at {row['return_s']} s)"


def attempt(env: dict, ranks: int, limit: float) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(r), str(ranks), str(port)],
            env={**base, **env, "NCCL_DEBUG": "WARN"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(ranks)
    ]
    t0 = time.monotonic()
    outs = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"ok": False, "error": f"timed out after {limit:.0f} s (a hang)", "seconds": limit}
        outs.append((p.returncode, o, e))
    row = {"seconds": round(time.monotonic() - t0, 2)}
    results = []
    for rc, o, e in outs:
        line = next((x for x in o.splitlines()[::-1] if x.startswith("{")), None)
        if rc != 0 or line is None:
            row.update(ok=False, error=_cause(e) or f"rc {rc}", stderr=e[-1500:])
            return row
        results.append(json.loads(line))
    row["ranks"] = results
    row["ok"] = all(all(r["ok"].values()) for r in results)
    return row


def _cause(stderr: str) -> str:
    """NCCL's own reason ('Last error:' and the line after it), else the last error line."""
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    for k, x in enumerate(lines):
        if x.startswith("Last error:") and k + 1 < len(lines):
            return lines[k + 1][:500]
    errors = [x for x in lines if "Error" in x or "error" in x]
    return (errors or lines or [""])[-1][:500]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nccl.json")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--limit", type=float, default=40)
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    if ns.dry_run:  # no export lines: nothing worked, nothing is exported
        with open(ns.out, "w") as f:
            json.dump({"dry_run": True, "tries": [], "chosen": None}, f)
        return
    import torch

    from labkit.engines.host import nccl_version

    report = {"nccl": ".".join(map(str, nccl_version() or ())), "torch": torch.__version__, "tries": []}
    chosen = None
    for ranks in ns.ranks:
        for name, env in SETTINGS:
            if ranks > 2 and not env:
                continue
            row = {"ranks": ranks, "setting": name, "env": env, **attempt(env, ranks, ns.limit)}
            report["tries"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "stderr"})[:1200], file=sys.stderr, flush=True)
            for r, got in enumerate(row.get("ranks", [])):  # when each rank's work completed, one line a rank
                verdict = (got.get("completion", {}).get("meter_blocking") or {}).get("verdict", "no probe row")
                print(f"meter verdict rank {r}: {verdict}", file=sys.stderr, flush=True)
            with open(ns.out, "w") as f:
                json.dump(report, f, indent=1)
            if row["ok"] and env:
                if ranks == ns.ranks[0]:
                    chosen = env
                break
    report["chosen"] = chosen
    with open(ns.out, "w") as f:
        json.dump(report, f, indent=1)
    for k, v in (chosen or {}).items():
        print(f"export {k}={v}")


if __name__ == "__main__":
    main()
