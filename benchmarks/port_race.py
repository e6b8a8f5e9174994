"""Lab starts beside a neighbour that takes ports: `python benchmarks/port_race.py [--starts 8] [--ports 2000]`.

ipyparallel picks its controller's ~18 TCP ports by binding port 0 and closing the socket, then binds them for
real later (the heart monitor, a forked process, a second or more later on a loaded machine). The kernel hands
the same range to every other process's port-0 binds and outgoing connections: a neighbour that holds
`--ports` of them, each set replaced every `--hold` seconds (0.3) (what gloo's listeners and connections do in
another test worker, many times over), takes one of the controller's now and then. Each start is made twice:
with labkit's retry (startup.START_ATTEMPTS) and with one attempt (what ipyparallel alone does). Prints per
start the seconds, the retries and whether it failed; the numbers are in benchmarks/RESULTS.md, "A
controller port taken before it is bound".
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import time

from labkit import Lab
from labkit.cluster import startup


def neighbour(ports: int, hold: float) -> None:
    """Hold `ports` OS-chosen listening ports, a new set every `hold` seconds, for ever."""
    while True:
        held = []
        for _ in range(ports):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            held.append(s)
        time.sleep(hold)
        for s in held:
            s.close()


def one_start(attempts: int) -> dict:
    startup.START_ATTEMPTS = attempts
    t = time.perf_counter()
    try:
        with Lab(engines=2, device="cpu", progress=False, timeout=60) as lab:
            retries = list(lab.engines.started.retries)
        failed = ""
    except Exception as e:  # what a user would have seen
        retries, failed = [], str(e).splitlines()[0][:120]
    return {"seconds": time.perf_counter() - t, "retries": retries, "failed": failed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--ports", type=int, default=2000)
    ap.add_argument("--hold", type=float, default=0.3)
    args = ap.parse_args()
    hog = multiprocessing.Process(target=neighbour, args=(args.ports, args.hold), daemon=True)
    hog.start()
    try:
        totals = {}
        for attempts in (startup.START_ATTEMPTS, 1):
            got = []
            for k in range(args.starts):
                got.append(one_start(attempts))
                r = got[-1]
                print(
                    f"attempts {attempts}, start {k}: {r['seconds']:.1f} s, {len(r['retries'])} retries"
                    + (f", FAILED: {r['failed']}" if r["failed"] else ""),
                    flush=True,
                )
            totals[attempts] = (sum(bool(r["failed"]) for r in got), sum(len(r["retries"]) for r in got))
    finally:
        hog.terminate()
    print(f"beside a neighbour holding {args.ports} ports, renewed every {args.hold} s; {args.starts} starts each:")
    for attempts, (failed, retries) in totals.items():
        print(f"  at most {attempts} attempt(s): {failed} failed, {retries} retries")


if __name__ == "__main__":
    main()
