"""The planner held against published training runs (labkit/theory/planner/published.py): for every row
the predicted and the published memory per GPU and tokens/s/GPU, with the errors; then, for each
run, where its own layout ranks among the planner's layouts of the same model on the same GPUs,
global batch and precision.

    python benchmarks/published.py              # the table, into benchmarks/RESULTS.md too (about a minute)
    python benchmarks/published.py --no-rank    # without the planner's search
    python benchmarks/published.py --out ''     # print only
    python benchmarks/published.py --pin        # re-write the pinned errors (benchmarks/data/published_errors.csv)

Memory is compared in the source's own statistic (Run.memory_stat): torchtitan's and this
workplace's max_memory_reserved is the allocated peak plus the allocator's slack
(theory/planner/gpu_memory.py reserved_bytes), without the CUDA context.

Every count below counts a row outside the tolerances as a miss, whatever term it names
(theory/planner/audit.py); `--pin` is run only in a commit that says which modelling change moved
which rows, and why.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from labkit import theory
from labkit.theory.planner import audit
from labkit.theory.planner.published import RUNS, Run

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- published.py table begin -->", "<!-- published.py table end -->"


def commit() -> str:
    """The code's commit (with '+' when the tree has uncommitted changes), for the tables' dates."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "../labkit"], cwd=HERE, capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def stamp() -> str:
    return f"{time.strftime('%Y-%m-%d')}, commit {commit()}"


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
        stack=run.stack,
    )
    best = found[0].tokens_per_second_per_gpu if found else float("nan")
    place = next(
        (i + 1 for i, p in enumerate(found) if p.tokens_per_second_per_gpu <= plan.tokens_per_second_per_gpu), None
    )
    return place, plan.tokens_per_second_per_gpu / best


def table(rows: list[dict], ranked: bool) -> list[str]:
    out = [
        "| run | tokens/s/GPU predicted | published | error | memory GiB predicted | published | error | bound"
        + (" | rank | vs best | rank, mesh held | vs best |" if ranked else " |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---"
        + (" | ---: | ---: | ---: | ---: |" if ranked else " |"),
    ]
    for r in rows:
        run, e = r["run"], r["error"]
        miss = "" if e.speed_within else " ✗"
        speed = f"{r['tps']:,.0f} | {run.tokens_per_second_per_gpu:,.0f} | {e.speed_error:+.0%}{miss}"
        if e.memory_ratio is None:
            mem = f"{r['memory']:.1f} | — | —"
        else:
            mem = f"{r['memory']:.1f} | {run.memory_gib:.1f} | {e.memory_error:+.0%}{'' if e.memory_within else ' ✗'}"
        line = f"| {run.name} | {speed} | {mem} | {r['bound']}"
        if ranked:
            line += f" | {r['place'] or '>5'} | {r['ratio']:.2f} | {r['held_place'] or '>5'} | {r['held_ratio']:.2f}"
        out.append(line + " |")
    return out


def summary(rows: list[dict], seconds: float) -> list[str]:
    errors = [r["error"] for r in rows]
    c = audit.counts(errors)
    lines = [
        f"Within {audit.SPEED_OK:.0%} on tokens/s/GPU: {c['speed today'][0]}/{c['speed today'][1]} rows run on today's "
        f"software (torchtitan, the steps measured here), {c['speed all'][0]}/{c['speed all'][1]} with llm-foundry's; "
        f"within {audit.MEMORY_OK:.0%} on memory: {c['memory all'][0]}/{c['memory all'][1]} of the rows that publish "
        f"it ({seconds:.0f} s). A named term never makes a miss a hit.",
    ]
    for family in dict.fromkeys(r["run"].family for r in rows):
        mine = [r["error"] for r in rows if r["run"].family == family]
        fam = audit.counts(mine)
        speed, memory = fam["speed all"], fam["memory all"]
        lines.append(f"- {family}: speed {speed[0]}/{speed[1]}, memory {memory[0]}/{memory[1]}")
    if rows and "place" in rows[0]:
        ok = sum(1 for r in rows if r["place"] is not None or r["ratio"] >= 0.9)
        held = sum(1 for r in rows if r["held_place"] is not None or r["held_ratio"] >= 0.9)
        lines.append(f"{ok}/{len(rows)} runs' own layouts among the planner's top 5 or within 10% of its best")
        lines.append(f"{held}/{len(rows)} the same with the planner holding each run's mesh and schedule")
    terms: dict[str, tuple[str, list[str]]] = {}
    unexplained = []
    for r in rows:
        e = r["error"]
        if e.speed_within and e.memory_within is not False:
            continue
        for t in r["run"].unpriced:
            terms.setdefault(t.term, (t.evidence, []))[1].append(r["run"].name)
        if not r["run"].unpriced:
            unexplained.append(r["run"].name)
    lines += ["", "Misses that name a term the model lacks (each term's evidence; the rows stay misses):"]
    lines += [f"- {term} ({len(names)} rows). Evidence: {ev}" for term, (ev, names) in terms.items()]
    some = f" ({', '.join(unexplained[:6])}, ...)" if unexplained else ""
    lines.append(f"- no term named: {len(unexplained)} rows{some}")
    return lines


def write_results(path: str, lines: list[str], begin: str = BEGIN, end: str = END, once: bool = False) -> bool:
    """Replace the block between the markers in RESULTS.md (add it at the end the first time);
    `once`: a block already there is kept. Returns whether the file was written."""
    text = open(path).read() if os.path.exists(path) else ""
    block = begin + "\n" + "\n".join(lines) + "\n" + end
    if begin in text:
        if once:
            return False
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-rank", action="store_true", help="skip the planner's search per run")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="where the table goes ('' for none)")
    ap.add_argument("--pin", action="store_true", help="re-write benchmarks/data/published_errors.csv")
    ns = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    for run, e in zip(RUNS, audit.errors(RUNS)):
        plan = theory.evaluate(run.config, run.model_config, hardware=run.hardware, stack=run.stack)
        r = {"run": run, "error": e, "tps": plan.tokens_per_second_per_gpu, "bound": plan.bound}
        r["memory"] = audit.predicted_memory(run, plan)
        if not ns.no_rank:
            r["place"], r["ratio"] = rank(run, plan)
            r["held_place"], r["held_ratio"] = rank(run, plan, HELD)
        rows.append(r)
        print(table([r], not ns.no_rank)[-1], flush=True)
    lines = [f"Measured {stamp()}.", ""] + table(rows, not ns.no_rank) + [""]
    lines += summary(rows, time.perf_counter() - t0)
    print("\n".join(lines[len(rows) + 4 :]))
    # the counts over every row the planner is held to, the Playbook's cells (benchmarks/playbook.py) included
    everything = audit.errors(audit.ALL)
    c = audit.counts(everything)
    lines.append(
        f"With the Playbook's {len(audit.ALL) - len(RUNS)} cells: tokens/s/GPU within {audit.SPEED_OK:.0%} on "
        f"{c['speed today'][0]}/{c['speed today'][1]} rows run on today's software, memory within "
        f"{audit.MEMORY_OK:.0%} on {c['memory all'][0]}/{c['memory all'][1]} rows that publish it."
    )
    print(lines[-1])
    if ns.pin:
        audit.write_pin(everything, f"written by benchmarks/published.py --pin on {stamp()}")
        print(f"pinned {len(everything)} rows in {os.path.relpath(audit.PIN)}")
    if ns.out:
        write_results(ns.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
