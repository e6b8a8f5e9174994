"""The timing-sensitive paths under load: Ctrl-C (and a Ctrl-C Python loses in a finalizer) stopping a
run, a skipped collective becoming a CollectiveTimeout, a raising rank a RankError — each repeated,
under changing load, with the failures counted (an interrupt that passed alone failed in
the full suite on a slower machine).

    python benchmarks/stress.py --repeats 100

Each repeat runs one fault on one 4-engine Lab, then a 2-step run that must match the one-process
reference (the Lab repaired and usable), under one of these loads, in turn:

  none        the machine as it is
  busy        two processes spinning on the CPU beside the cluster (a 2-core machine: both cores)
  neighbour   another 2-engine Lab training in a second process
  pinned      every engine of the Lab pinned to one core

A repeat fails if the fault does not end in its error, if the stop takes longer than its promise
(an interrupt: the step's time + engines/runtime.py LATE_S; a hang: the timeout + faults.py's bounds),
if a rank is left running, or if the next run does not match. The count of failures must be 0;
benchmarks/RESULTS.md holds the runs.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import psutil

from labkit import CollectiveTimeout, ModelConfig, ParallelConfig, RankError, reference
from labkit.engines.runtime import LATE_S
from labkit.oracle.checks import mismatches

TINY = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=128, seq=16)
HANG_S = 10.0
LOADS = ("none", "busy", "neighbour", "pinned")
INTERRUPT_BOUND_S = 1.0 + LATE_S
"""An interrupt's promise: the rest of the step it lands in (TINY's: < 0.1 s, 1 s under load) and, at
worst, LATE_S for a step that does not end."""
HANG_BOUND_S = HANG_S + 8.0
"""A hang's promise: the timeout, then the logs read and the ranks released (faults.RELEASE_S, 3 s),
with 5 s for a loaded 2-core machine to schedule the engines that answer."""


def _spin():
    while True:
        pass


@contextlib.contextmanager
def load(kind: str, lab):
    """The load `kind` for the length of the block."""
    procs = []
    pinned = []
    try:
        if kind == "busy":
            procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(2)]
            for p in procs:
                p.start()
        elif kind == "neighbour":
            code = (
                "from labkit import Lab, ParallelConfig, ModelConfig\n"
                "m = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=128, seq=16)\n"
                "with Lab(engines=2, progress=False, device='cpu') as lab:\n"
                "    while True: lab.run(ParallelConfig(dp=2), model=m, steps=20)\n"
            )
            procs = [
                subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            ]
            time.sleep(20)  # its Lab up and training
        elif kind == "pinned":
            for pid in lab.engines.pids:
                p = psutil.Process(pid)
                pinned.append((p, p.cpu_affinity()))
                p.cpu_affinity([0])
        yield
    finally:
        for p in procs:
            if isinstance(p, subprocess.Popen):
                p.send_signal(signal.SIGINT)  # its Lab closes, its watchdog ends its engines
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
            else:
                p.terminate()
        for p, cores in pinned:
            with contextlib.suppress(psutil.Error):
                p.cpu_affinity(cores)


class _Finalized:
    """Calls the SIGINT handler from its __del__, where Python loses the KeyboardInterrupt it raises."""

    def __del__(self):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)


def interrupt(lab, lost: bool) -> tuple[str, float]:
    """Ctrl-C during a long run: (what came of it, seconds from the Ctrl-C to the error)."""
    sent: dict = {}

    def progress(rec):
        if not sent:
            sent["at"] = time.monotonic()
            if lost:
                _Finalized()
            else:
                threading.Timer(0.3, _thread.interrupt_main).start()

    try:
        lab.run(ParallelConfig(dp=4), model=TINY, steps=100000, timeout=120, progress=progress)
        return "finished", 0.0
    except BaseException as e:  # noqa: BLE001 - what came of the Ctrl-C is the measurement
        took = time.monotonic() - sent.get("at", time.monotonic()) - (0.0 if lost else 0.3)
        return type(e).__name__, took


def _skip_collective():
    import torch
    import torch.distributed as dist

    t = torch.ones(8)
    if dist.get_rank() != 2:
        dist.all_reduce(t)
    return float(t[0])


def _rank_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def hang(lab, fn) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        lab.apply(fn, timeout=HANG_S)
        return "finished", 0.0
    except (CollectiveTimeout, RankError) as e:
        return type(e).__name__, time.monotonic() - t0


FAULTS = {
    "interrupt": (lambda lab: interrupt(lab, False), "KeyboardInterrupt", INTERRUPT_BOUND_S),
    "lost interrupt": (lambda lab: interrupt(lab, True), "KeyboardInterrupt", INTERRUPT_BOUND_S),
    "skipped collective": (lambda lab: hang(lab, _skip_collective), "CollectiveTimeout", HANG_BOUND_S),
    "raising rank": (lambda lab: hang(lab, _rank_raises), "RankError", 8.0),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=100, help="repeats of each interrupt (the hangs: a quarter)")
    ap.add_argument("--json", help="write every repeat here")
    args = ap.parse_args(argv)
    from labkit import Lab

    # Ctrl-C handled as a notebook's kernel handles it (ipykernel installs default_int_handler while a cell
    # runs): started in the background without job control, this process inherits SIGINT ignored, and
    # `_thread.interrupt_main` does nothing there (tests/test_faults.py `ctrl_c`)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    ref = reference(TINY, steps=2)
    plan = [(f, LOADS[i % len(LOADS)]) for i in range(args.repeats) for f in ("interrupt", "lost interrupt")]
    plan += [
        (f, LOADS[i % len(LOADS)]) for i in range(args.repeats // 4) for f in ("skipped collective", "raising rank")
    ]
    rows, t0 = [], time.monotonic()
    with Lab(engines=4, timeout=60, progress=False, device="cpu") as lab:
        for n, (fault, kind) in enumerate(plan):
            run, want, bound = FAULTS[fault]
            with load(kind, lab):
                got, took = run(lab)
                states = lab.engine_states()
            after = lab.run(ParallelConfig(dp=4), model=TINY, steps=2, return_params=True, timeout=120)
            wrong = [str(m) for m in mismatches(after, ref)]
            ok = got == want and took <= bound and "running" not in states and not wrong
            rows.append({"fault": fault, "load": kind, "got": got, "seconds": took, "states": states, "ok": ok})
            print(f"{n + 1}/{len(plan)} {fault:<18} {kind:<9} {got:<18} {took:6.2f} s {states} {'ok' if ok else 'FAIL'}"
                  + (f" next run: {wrong[0]}" if wrong else ""), flush=True)  # fmt: skip
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows)} faults in {time.monotonic() - t0:.0f} s, {len(failed)} failed (pid {os.getpid()})")
    for fault in FAULTS:
        mine = [r["seconds"] for r in rows if r["fault"] == fault]
        if mine:
            print(f"  {fault:<18} {len(mine)} runs, stop after {min(mine):.2f} to {max(mine):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
