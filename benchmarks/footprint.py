"""What Lab(engines=4) holds in memory after one run, per process (labkit/cluster/footprint.py).

    python benchmarks/footprint.py [--engines 4] [--interpreter-each]

Starts a Lab, runs the default demo model (dp2 x tp2, 3 steps), then prints every process the
Lab started (controller and its children, the engines and the process they were forked from, the
watchdog) and the kernel (this process) with RSS, USS and PSS, the start time, and the sum that a
Binder pod's 2 GB must hold. --interpreter-each: the engines started by ipyparallel's own local
launcher instead, an interpreter each (the baseline of labkit/cluster/forked.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import psutil

from labkit import Lab, ModelConfig, ParallelConfig
from labkit.cluster import launchers
from labkit.cluster.footprint import MIB, by_role, footprint, table


def interpreter_each() -> None:
    """Every local Lab of this process starts its engines with ipyparallel's own local launcher
    (a Lab has no option for it: the forked engines are what it uses)."""
    settings = launchers.cluster_settings

    def local(*args, **kwargs):
        got, config = settings(*args, **kwargs)
        got["engines"] = "local"
        return got, config

    launchers.cluster_settings = local


def lab_pids(lab) -> tuple[list[int], int | None]:
    """Every process of a local Lab: the controller and its descendants, the engines and theirs,
    whatever else carries the Lab's tag, and its watchdog (which carries none)."""
    ctrl = lab.engines.cluster.controller.pid
    pids = {ctrl, *(p.pid for p in psutil.Process(ctrl).children(recursive=True))}
    for pid in lab.engines.pids:
        pids |= {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    tagged = getattr(lab.engines, "processes", None)  # absent before engines were tagged (the "before" numbers)
    if tagged is not None:
        pids |= {p.pid for p in tagged()} | {lab.engines.watchdog.proc.pid}
    return sorted(pids), ctrl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--interpreter-each", action="store_true", help="ipyparallel's local launcher (the baseline)")
    args = ap.parse_args()
    if args.interpreter_each:
        interpreter_each()
    t0 = time.perf_counter()
    with Lab(engines=args.engines, progress=False, device="cpu") as lab:
        started = time.perf_counter() - t0
        lab.run(ParallelConfig(dp=2, tp=2), model=ModelConfig(), steps=3)
        pids, ctrl = lab_pids(lab)
        rows = footprint(pids, lab.engines.pids, ctrl, kernel=os.getpid())
    print(f"Lab(engines={args.engines}) started in {started:.1f} s; after one run:")
    print(table(rows))
    total = by_role(rows)["all"]
    print(f"{total['count']} processes, PSS {total['pss'] / MIB:.0f} MiB, RSS {total['rss'] / MIB:.0f} MiB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
