"""How fast the lab answers without a cluster: the planner's searches and the widgets' redraws.

These were bounds inside the test suite (a plan under 2 s, a redraw under 0.1 s), which a slower
machine of the same kind failed without the code changing; here they are measured and
recorded (benchmarks/RESULTS.md). Each is CPU seconds of this process (on a shared machine, wall
time measures the neighbours), and beside each a ratio to a fixed pure-Python workload timed in the
same run (`baseline`), which a faster or slower machine scales alike: the ratio compares runs on
different machines, the seconds answer "how long will I wait".

    python benchmarks/speed.py [--repeats 3]

The promise checked against: `labkit plan --model llama3.1-405b --gpus 1024 --seq 16384` in <= 1 s
on the machine the suite runs on.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BASELINE_N = 2_000_000


def baseline() -> float:
    """CPU seconds of a fixed pure-Python loop: the machine's speed at what the planner does (dicts,
    small objects, arithmetic on floats)."""
    t0 = time.process_time()
    acc, d = 0.0, {}
    for i in range(BASELINE_N):
        d[i & 1023] = acc
        acc += (i % 7) * 0.5
    return time.process_time() - t0


PLANS = {
    "plan 405B on 1,024 GPUs at 16k (the CLI's question)": (
        "from labkit.theory.presets import LLAMA_405B as m; from labkit import theory; "
        "theory.plan(m.replace(seq=16384), 1024)"
    ),
    "plan 405B on 16,384 GPUs, batch 2,048": (
        "from labkit.theory.presets import LLAMA_405B as m; from labkit import theory; "
        "theory.plan(m, 16384, global_batch=2048)"
    ),
}
"""Each in a fresh process, as a user's first question is: no cache of an earlier search helps it."""


def cold(code: str) -> float:
    """CPU seconds of `code` in a fresh interpreter, imports excluded."""
    script = f"import time, labkit.theory; t0 = time.process_time(); {code}; print(time.process_time() - t0)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def widgets() -> dict[str, float]:
    """The mesh view at 16,384 ranks, and the ScaleExplorer's redraw after a control change (median)."""
    from labkit.layout.mesh import MeshLayout
    from labkit.widgets import figures
    from labkit.widgets.scale import ScaleExplorer

    t0 = time.process_time()
    figures.mesh_figure(MeshLayout.from_sizes(tp=8, dp=256, pp=8), "tp")
    mesh = time.process_time() - t0
    x = ScaleExplorer(model="llama-7b", gpus=64, tp=8)
    took = []
    for field, value in [("microbatches", 4), ("pp", 2), ("sharding", "zero1"), ("precision", "fp32"), ("gpus", 128),
                         ("tp", 4), ("pp", 4), ("microbatches", 16), ("gpus", 256), ("cp", 2)]:  # fmt: skip
        x.controls[field].value = value
        x.wait()
        took.append(x.timings["update_cpu"])
    return {"mesh figure, 16,384 ranks": mesh, "ScaleExplorer redraw (median of 10 changes)": statistics.median(took)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    base = statistics.median(baseline() for _ in range(args.repeats))
    rows = {name: statistics.median(cold(code) for _ in range(args.repeats)) for name, code in PLANS.items()}
    rows.update(widgets())
    print(f"baseline (pure-Python loop of {BASELINE_N:,}): {base:.3f} s CPU")
    print(f"{'':<60} {'CPU s':>8} {'/ baseline':>11}")
    for name, s in rows.items():
        print(f"{name:<60} {s:>8.3f} {s / base:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
