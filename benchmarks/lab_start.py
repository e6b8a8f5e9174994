"""A local Lab's start and close, phase by phase: `python benchmarks/lab_start.py [--engines 4] [--repeats 3]`.

Each repeat starts the engines both ways, one after the other: forked from one process that imported
torch once (labkit's, launchers.ForkedEngines) and ipyparallel's own local launcher (an interpreter per
engine), and prints, beside the phases, the CPU seconds the Lab's processes used from start to close and
the engines' memory (PSS, shared pages split among the processes sharing them) once the world is built.

The phases are startup.start_cluster's and EngineSet.setup's, called one at a time: the controller started, the
engines launched (ipyparallel waits for the controller's connection file first), every engine registered
(ipyparallel counts one at the first controller heartbeat it answers: launchers.HEARTBEAT_MS), one torch
world (each engine imports torch in `engine_info`, then the rendezvous), closed (the engines end at SIGTERM:
engines/host.py `end_at_once_on_sigterm`). Prints each phase's seconds and their medians; the numbers are in
benchmarks/RESULTS.md, "The suite on two workers, a Lab started and closed faster".
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import ipyparallel as ipp
import psutil

from labkit.cluster import launchers, startup
from labkit.cluster.engine_set import EngineSet

PHASES = ("controller", "engines launched", "registered", "one torch world", "closed")
KINDS = {"forked": launchers.ForkedEngines, "ipyparallel": "local"}
"""How the engines start: labkit's way, and ipyparallel's own local launcher (the baseline)."""


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended and been waited for (their own
    children's included, as far as each waited for them)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def once(n: int, kind: str) -> dict[str, float]:
    """Seconds of each phase of one n-engine start and close, the CPU seconds its processes used
    ('cpu') and the engines' PSS in MiB once the world is built ('pss MiB')."""
    took, t, cpu = {}, time.perf_counter(), children_cpu()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        took[name], t = now - t, now

    kwargs, _ = launchers.cluster_settings("local", n, "bench", {}, {})
    kwargs["engines"] = KINDS[kind]
    cluster = ipp.Cluster(**kwargs)
    try:
        cluster.start_controller_sync()
        phase("controller")
        cluster.start_engines_sync(n)
        phase("engines launched")
        client = cluster.connect_client_sync()
        startup.wait_for(client, n)
        phase("registered")
        engines = EngineSet(client, cluster, n, local=True, backend="auto", device="cpu", timeout=60, master_addr=None)
        engines.setup()
        phase("one torch world")
        took["pss MiB"] = sum(psutil.Process(pid).memory_full_info().pss for pid in engines.pids) / 2**20
    except BaseException:
        launchers.stop(cluster)
        raise
    engines.close()
    phase("closed")
    took["cpu"] = children_cpu() - cpu
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = {kind: [] for kind in KINDS}
    for k in range(args.repeats):
        for kind, done in runs.items():
            done.append(once(args.engines, kind))
            print(f"run {k}, {kind}: " + ", ".join(f"{p} {v:.2f}" for p, v in done[-1].items()), flush=True)
    print(f"median of {args.repeats}, {args.engines} engines: " + " | ".join(KINDS))
    for r in (r for done in runs.values() for r in done):
        r["start"] = sum(r[p] for p in PHASES[:-1])
    for p in (*PHASES, "start", "cpu", "pss MiB"):
        print(f"  {p:18s} " + " | ".join(f"{statistics.median(r[p] for r in runs[kind]):8.2f}" for kind in KINDS))


if __name__ == "__main__":
    main()
