"""A local Lab's start and close, phase by phase: `python benchmarks/lab_start.py [--engines 4] [--repeats 3]`.

The phases are startup.start_cluster's and EngineSet.setup's, called one at a time: the controller started, the
engines launched (ipyparallel waits for the controller's connection file first), every engine registered
(ipyparallel counts one at the first controller heartbeat it answers: launchers.HEARTBEAT_MS), one torch
world (each engine imports torch in `engine_info`, then the rendezvous), closed (the engines end at SIGTERM:
engines/host.py `end_at_once_on_sigterm`). Prints each phase's seconds and their medians; the numbers are in
benchmarks/RESULTS.md, "The suite on two workers, a Lab started and closed faster".
"""

from __future__ import annotations

import argparse
import statistics
import time

import ipyparallel as ipp

from labkit.cluster import launchers, startup
from labkit.cluster.engine_set import EngineSet

PHASES = ("controller", "engines launched", "registered", "one torch world", "closed")


def once(n: int) -> dict[str, float]:
    """Seconds of each phase of one n-engine start and close."""
    took, t = {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        took[name], t = now - t, now

    kwargs, _ = launchers.cluster_settings("local", n, "bench", {}, {})
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
    except BaseException:
        launchers.stop(cluster)
        raise
    engines.close()
    phase("closed")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for k in range(args.repeats):
        runs.append(once(args.engines))
        print(f"run {k}: " + ", ".join(f"{p} {runs[-1][p]:.2f} s" for p in PHASES), flush=True)
    print(f"median of {args.repeats}, {args.engines} engines:")
    for p in PHASES:
        print(f"  {p:18s} {statistics.median(r[p] for r in runs):6.2f} s")
    print(f"  {'start':18s} {statistics.median(sum(r[p] for p in PHASES[:-1]) for r in runs):6.2f} s")


if __name__ == "__main__":
    main()
