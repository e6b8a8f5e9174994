"""The planner held against published training runs (labkit/theory/planner/published.py): for every row
the predicted and the published memory per GPU and tokens/s/GPU, with the errors; then, for each
run, where its own layout ranks among the planner's layouts of the same model on the same GPUs,
global batch and precision.

    python benchmarks/published.py              # the table, into benchmarks/RESULTS.md too (about a minute)
    python benchmarks/published.py --no-rank    # without the planner's search
    python benchmarks/published.py --out ''     # print only

Memory is compared as the source measures it: torchtitan's max_memory_reserved is the allocated
peak plus the allocator's slack (theory/planner/gpu_memory.py reserved_bytes), without the CUDA context.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from labkit import theory
from labkit.theory.planner.gpu_memory import reserved_bytes
from labkit.theory.planner.published import RUNS, Run

GiB = 2**30
MEMORY_OK, SPEED_OK = 0.15, 0.25
HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- published.py table begin -->", "<!-- published.py table end -->"


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


HELD = ("dp", "tp", "pp", "cp", "ep", "schedule")
"""What the second ranking holds as the run had it: its mesh and its pipeline schedule (the
planner then chooses sharding, microbatches, checkpointing, SP and virtual stages)."""


def rank(run: Run, plan, held: tuple[str, ...] = ()) -> tuple[int | None, float]:
    """(the published layout's place among the planner's layouts, 1-based, or None past the
    top 5; its predicted throughput over the best one's), the planner holding `held` of the
    run's layout fields."""
    found = theory.plan(
        run.model_config,
        run.config.world,
        hardware=run.hardware,
        global_batch=run.config.global_batch,
        top=5,
        precision=run.config.precision,
        fixed={k: getattr(run.config, k) for k in held},
    )
    best = found[0].tokens_per_second_per_gpu if found else float("nan")
    place = next(
        (i + 1 for i, p in enumerate(found) if p.tokens_per_second_per_gpu <= plan.tokens_per_second_per_gpu), None
    )
    return place, plan.tokens_per_second_per_gpu / best


def table(rows: list[dict], runs: list[Run], ranked: bool) -> list[str]:
    out = [
        "| run | tokens/s/GPU predicted | published | error | memory GiB predicted | published | error | bound"
        + (" | rank | vs best |" if ranked else " |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---" + (" | ---: | ---: |" if ranked else " |"),
    ]
    for run, r in zip(runs, rows):
        mem = (
            f"{r['memory']:.1f} | {r['memory_published']:.1f} | {r['memory_error']:+.0%}"
            if r["memory_published"] is not None
            else f"{r['memory']:.1f} | — | —"
        )
        speed = f"{r['tps']:,.0f} | {run.tokens_per_second_per_gpu:,.0f} | {r['tps_error']:+.0%}"
        line = f"| {run.name} | {speed} | {mem} | {r['bound']}"
        held = f" | {r['held_place'] or '>5'} | {r['held_ratio']:.2f}" if ranked else ""
        out.append(line + (f" | {r['place'] or '>5'} | {r['ratio']:.2f}{held} |" if ranked else " |"))
    return out


def summary(rows: list[dict], runs: list[Run], seconds: float) -> list[str]:
    speed_ok = sum(abs(r["tps_error"]) <= SPEED_OK for r in rows)
    with_memory = [r for r in rows if r["memory_error"] is not None]
    memory_ok = sum(abs(r["memory_error"]) <= MEMORY_OK for r in with_memory)
    lines = [
        f"{speed_ok}/{len(rows)} rows within {SPEED_OK:.0%} on tokens/s/GPU; {memory_ok}/{len(with_memory)} within "
        f"{MEMORY_OK:.0%} on memory ({seconds:.0f} s)"
    ]
    if rows and "place" in rows[0]:
        ok = sum(1 for r in rows if r["place"] is not None or r["ratio"] >= 0.9)
        lines.append(f"{ok}/{len(rows)} runs' own layouts among the planner's top 5 or within 10% of its best")
        held = sum(1 for r in rows if r["held_place"] is not None or r["held_ratio"] >= 0.9)
        lines.append(f"{held}/{len(rows)} the same with the planner holding each run's mesh and schedule")
    misses = {term for run in runs for term in run.missing}
    lines += ["", "Terms the model lacks, named by the rows that use them:"] + [f"- {m}" for m in sorted(misses)]
    return lines


def write_results(path: str, lines: list[str]) -> None:
    """Replace the block between the markers in RESULTS.md (add it at the end the first time)."""
    text = open(path).read() if os.path.exists(path) else ""
    block = BEGIN + "\n" + "\n".join(lines) + "\n" + END
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-rank", action="store_true", help="skip the planner's search per run")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="where the table goes ('' for none)")
    ns = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    for run in RUNS:
        r = compare(run)
        if not ns.no_rank:
            r["place"], r["ratio"] = rank(run, r["plan"])
            r["held_place"], r["held_ratio"] = rank(run, r["plan"], HELD)
        rows.append(r)
        print(table([r], [run], not ns.no_rank)[-1], flush=True)
    lines = table(rows, RUNS, not ns.no_rank) + [""] + summary(rows, RUNS, time.perf_counter() - t0)
    print("\n".join(lines[len(rows) + 2 :]))
    if ns.out:
        write_results(ns.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
