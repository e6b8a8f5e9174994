"""The planner's missing measurements on a GPU, as points for
benchmarks/data/planner_measurements.json (labkit/theory/planner/measured.py reads them).

    python benchmarks/gpu_planner.py --out planner.json [--parts pace fsdp nccl]   # on a CUDA GPU, ~90 s
    python benchmarks/gpu_planner.py --dry-run --out planner.json                 # arguments and frame only
    python benchmarks/gpu_planner.py --merge planner.json        # afterwards, anywhere: into the data file

  pace   eager one-process steps (fp32 masters, bf16 autocast, fused AdamW; benchmarks/gpu_mfu.py's loop)
         profiled, at three kernel sizes: GPT-2 124M (16 x 1024), Llama 3.2 1B (8 x 2048), and two blocks
         of Llama 3.1 8B (2 x 8192): the 'other' kernels' seconds over the seconds the model gives the
         elementwise kernels at this device's roofline (stacks.py `priced`), filed under stacks.py
         `kernel_bytes`
  fsdp   one FSDP2 step on one GPU (a world of one, fully_shard per block, bf16 params, fp32 reduce),
         Llama 3.2 1B at 4 x 2048, profiled: FSDP's copy ops (all_gather_copy_in, split_with_sizes_copy,
         chunk_cat) over stacks.py `fsdp_copy_seconds`, the elementwise kernels and the optimizer as above
  nccl   all-reduces of 8 B to 1 MiB over every GPU of the machine, or two ranks on one GPU where it has
         one (recorded, not read: measured.py reads a node's GPUs only), and the channels NCCL opened
         (NCCL_DEBUG=INFO's 'Channel xx/yy')

`--merge` appends the points to the data file and refuses the lot if any is a row the planner is
judged on (audit.calibration_problems): calibration rows never become validation rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

PARTS = ("pace", "fsdp", "nccl")
PACE_STEPS = [("gpt2-124m", 16, 1024, None), ("llama3.2-1b", 8, 2048, None), ("llama3.1-8b", 2, 8192, 2)]
"""(preset, batch, seq, layers): the three kernel sizes; the 8B cut to two blocks to fit one GPU's step."""
FSDP_STEP = ("llama3.2-1b", 4, 2048)
COPY_OPS = ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
"""FSDP2's copies around its collectives, by their ops' names (torch.distributed.fsdp's custom ops)."""
SIZES = (8, 1 << 10, 1 << 16, 1 << 20)
"""All-reduce payloads, bytes: latency-bound to the first that is not."""


def _hardware(device_name: str):
    from gpu_mfu import hardware_of_device

    from labkit.theory.planner.hardware import HARDWARE

    return HARDWARE[hardware_of_device(device_name)]


def pace_points(steps: int) -> list[dict]:
    import torch
    from gpu_mfu import one_process

    from labkit.theory.planner import stacks
    from labkit.theory.presets import PRESETS

    device = torch.cuda.get_device_name()
    hw, out = _hardware(device), []
    for name, batch, seq, layers in PACE_STEPS:
        model = PRESETS[name].replace(seq=seq, **({"layers": layers} if layers else {}))
        got = one_process(model, batch, steps, compiled=False)
        row = {"model": name, "batch": batch, "seq": seq, **({"layers": layers} if layers else {})}
        memory, _ = stacks.priced(row, hw)
        point = {"device": device, "stack": "eager", **row, "kernel_bytes": stacks.kernel_bytes(row)}
        point["memory_slowdown"] = got["kernels"]["kernel_s"]["other"] / memory
        point["source"] = (
            f"benchmarks/gpu_planner.py pace, {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
        )
        out.append({**point, "step_s": got["step_s"], "kernel_s": got["kernels"]["kernel_s"]})
        print(json.dumps(out[-1]), flush=True)
        torch.cuda.empty_cache()
    return out


def fsdp_point(steps: int) -> dict:
    """One FSDP2 step of labkit's model on a world of one, profiled."""
    import torch
    import torch.distributed as dist
    from gpu_mfu import KINDS
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.profiler import ProfilerActivity, profile

    from labkit.engines.model import build_model
    from labkit.theory.planner import stacks
    from labkit.theory.presets import PRESETS

    name, batch, seq = FSDP_STEP
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    cfg = PRESETS[name].replace(seq=seq)
    net = build_model(cfg, seed=0).cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(net, mp_policy=mp)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), device="cuda")

    def step():
        net(tokens, torch.roll(tokens, -1, dims=1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    # device time under each op (torch >= 2.4 names it device_*, before cuda_*: gpu_mfu.profile_step reads both)
    total = lambda e: e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    copies = {e.key: total(e) / 1e6 for e in prof.key_averages() if any(c in e.key for c in COPY_OPS)}
    kinds = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kind = next((k for k, keys in KINDS if any(x in e.name.lower() for x in keys)), "other")
            kinds[kind] += (e.device_time if hasattr(e, "device_time") else e.cuda_time) / 1e6
    device = torch.cuda.get_device_name()
    hw = _hardware(device)
    row = {"model": name, "batch": batch, "seq": seq, "world": 1}
    memory, optimizer = stacks.priced(row, hw)
    # the copies' kernels are among the profiler's 'other' ones: taken out before the elementwise pace
    copy_s = sum(copies.values())
    point = {"device": device, "stack": "eager", **row, "copy_slowdown": copy_s / stacks.fsdp_copy_seconds(row, hw)}
    point["memory_slowdown"] = (kinds["other"] - copy_s) / memory
    point["optimizer_slowdown"] = kinds["optimizer"] / optimizer
    point["source"] = (
        f"benchmarks/gpu_planner.py fsdp, {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )
    dist.destroy_process_group()
    return {**point, "copy_ops_s": copies, "kernel_s": kinds}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_worker(rank: int, world: int, port: int, gpus: int) -> dict:
    """One rank: each payload's all-reduce, median of 50 after 10 warm-ups, CUDA events."""
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=dev)
    out = {}
    for size in SIZES:
        x = torch.ones(max(1, size // 4), device=dev)
        times = []
        for i in range(60):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x)
            end.record()
            end.synchronize()
            if i >= 10:
                times.append(start.elapsed_time(end) / 1e3)
        out[str(size)] = statistics.median(times)
    dist.destroy_process_group()
    return out


def nccl_points(limit: float) -> list[dict]:
    import torch

    gpus = torch.cuda.device_count()
    world = max(2, gpus)  # one GPU: two ranks on it (NCCL >= 2.30 with the flag gpu-check.sh exports)
    port = _free_port()
    from labkit.cluster.world import NCCL_SHARED_ENV

    # ranks sharing a GPU need the flag the Lab sets on its engines; the environment's own NCCL_* win
    shared = NCCL_SHARED_ENV if world > gpus else {}
    env = {**shared, **os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--nccl-worker", str(r), str(world), str(port), str(gpus)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=limit)[0] for p in procs]
    finally:
        for p in procs:  # a hang leaves none behind
            if p.poll() is None:
                p.kill()
    channels = [int(m) for o in outs for m in re.findall(r"Channel \d+/(\d+)", o)]
    line = next((x for x in outs[0].splitlines()[::-1] if x.startswith("{")), None)
    if procs[0].returncode or line is None:
        return [{"error": (outs[0].strip().splitlines() or ["no output"])[-1][:500]}]
    device = torch.cuda.get_device_name()
    source = f"benchmarks/gpu_planner.py nccl, {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    base = {"device": device, "gpus": gpus, "ranks_per_gpu": world // gpus, "op": "all_reduce", "source": source}
    return [
        {**base, "bytes": int(size), "seconds": s, "channels": max(channels) if channels else None}
        for size, s in json.loads(line).items()
    ]


def merge(got_path: str, into: str | None = None) -> list[str]:
    """Append the points of a run to the data file; nothing is written if any point is refused."""
    from labkit.theory.planner import audit, measured

    into = into or measured.PATH
    with open(got_path) as f:
        got = json.load(f)
    with open(into) as f:
        data = json.load(f)
    fields = {k: set(v) | {"layers", "channels"} for k, v in measured.FIELDS.items()}  # and the optional ones
    for key in measured.FIELDS:
        data[key] += [{k: v for k, v in p.items() if k in fields[key]} for p in got.get(key, []) if "error" not in p]
    tmp = into + ".new"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    found = audit.calibration_problems(tmp)
    if found:
        os.remove(tmp)
        return found
    os.replace(tmp, into)
    return []


def main() -> None:
    if "--nccl-worker" in sys.argv:
        i = sys.argv.index("--nccl-worker")
        print(json.dumps(nccl_worker(*map(int, sys.argv[i + 1 : i + 5]))), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="planner.json")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--merge", default=None, help="a run's JSON: its points into benchmarks/data/")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    if ns.merge:
        found = merge(ns.merge)
        sys.exit("\n".join(["refused, nothing written:", *found]) if found else 0)
    out: dict = {"parts": ns.parts, "eager_pace": [], "fsdp_step": [], "nccl": []}

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    if ns.dry_run:
        out["dry_run"] = True
        return save()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run)")
    for part, key, fn in (
        ("nccl", "nccl", lambda: nccl_points(60)),
        ("pace", "eager_pace", lambda: pace_points(ns.steps)),
        ("fsdp", "fsdp_step", lambda: [fsdp_point(ns.steps)]),
    ):
        if part in ns.parts:
            try:
                out[key] = fn()
            except Exception as e:  # noqa: BLE001 - recorded, the next part runs
                out[f"{part}_error"] = f"{type(e).__name__}: {e}"[:2000]
            save()
    print(json.dumps({k: len(v) for k, v in out.items() if isinstance(v, list)}), flush=True)


if __name__ == "__main__":
    main()
