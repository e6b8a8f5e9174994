"""The planner held against published training runs (labkit/theory/published.py): for every row
the predicted and the published memory per GPU and tokens/s/GPU, with the errors; then, for each
run, where its own layout ranks among the planner's layouts of the same model on the same GPUs,
global batch and precision.

    python benchmarks/published.py              # the table (pure Python, about a minute)
    python benchmarks/published.py --no-rank    # without the planner's search

Memory is compared as the source measures it: torchtitan's max_memory_reserved is the allocated
peak plus the allocator's slack (theory/gpu_memory.py reserved_bytes), without the CUDA context.
"""

from __future__ import annotations

import argparse
import sys
import time

from labkit import theory
from labkit.theory.gpu_memory import reserved_bytes
from labkit.theory.published import RUNS, Run

GiB = 2**30
MEMORY_OK, SPEED_OK = 0.15, 0.25


def compare(run: Run) -> dict:
    plan = theory.evaluate(run.config, run.model_config, hardware=run.hardware)
    out = {
        "run": run.name,
        "tps": plan.tokens_per_second_per_gpu,
        "tps_published": run.tokens_per_second_per_gpu,
        "tps_error": plan.tokens_per_second_per_gpu / run.tokens_per_second_per_gpu - 1,
        "memory": reserved_bytes(plan.memory) / GiB,
        "memory_published": run.memory_gib,
        "memory_error": None,
        "bound": plan.bound,
        "mfu": plan.mfu,
        "plan": plan,
    }
    if run.memory_gib is not None:
        out["memory_error"] = out["memory"] / run.memory_gib - 1
    return out


def rank(run: Run, plan) -> tuple[int | None, float]:
    """(the published layout's place among the planner's layouts, 1-based, or None past the
    top 5; its predicted throughput over the best one's)."""
    found = theory.plan(
        run.model_config,
        run.config.world,
        hardware=run.hardware,
        global_batch=run.config.global_batch,
        top=5,
        precision=run.config.precision,
    )
    best = found[0].tokens_per_second_per_gpu if found else float("nan")
    place = next(
        (i + 1 for i, p in enumerate(found) if p.tokens_per_second_per_gpu <= plan.tokens_per_second_per_gpu), None
    )
    return place, plan.tokens_per_second_per_gpu / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-rank", action="store_true", help="skip the planner's search per run")
    ns = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    print("| run | tokens/s/GPU predicted | published | error | memory GiB predicted | published | error", end="")
    print(" | bound | rank | vs best |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for run in RUNS:
        r = compare(run)
        place, ratio = (None, float("nan")) if ns.no_rank else rank(run, r["plan"])
        r["place"], r["ratio"] = place, ratio
        rows.append(r)
        mem = (
            f"{r['memory']:.1f} | {r['memory_published']:.1f} | {r['memory_error']:+.0%}"
            if r["memory_published"] is not None
            else f"{r['memory']:.1f} | — | —"
        )
        print(
            f"| {run.name} | {r['tps']:,.0f} | {run.tokens_per_second_per_gpu:,.0f} | {r['tps_error']:+.0%} | {mem} | "
            f"{r['bound']} | {place or '>5'} | {ratio:.2f} |",
            flush=True,
        )
    speed_ok = sum(abs(r["tps_error"]) <= SPEED_OK for r in rows)
    with_memory = [r for r in rows if r["memory_error"] is not None]
    memory_ok = sum(abs(r["memory_error"]) <= MEMORY_OK for r in with_memory)
    print(
        f"\n{speed_ok}/{len(rows)} rows within {SPEED_OK:.0%} on tokens/s/GPU; {memory_ok}/{len(with_memory)} within "
        f"{MEMORY_OK:.0%} on memory ({time.perf_counter() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
