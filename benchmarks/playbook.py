"""The planner against the Ultra-Scale Playbook's best configurations (labkit/theory/planner/playbook.py):
the predicted MFU and memory of each of the 26 cells against what nanotron measured, and whether the
Playbook's layout is among the planner's top 5, or within 10% of its best, searched over the sweep's
own space (dp/tp/pp with tp up to 32, ZeRO 0/1, micro-batch and accumulation, 1F1B, no cp, no
recomputation, bf16) and unrestricted (bf16).

    python benchmarks/playbook.py            # the table into benchmarks/RESULTS.md (the latest block)
    python benchmarks/playbook.py --blind    # the first prediction's block: written once, never replaced
    python benchmarks/playbook.py --out ''   # print only

The blind block is the prediction made before any modelling change for this data; later runs write
the latest block beside it, each dated with the code's commit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from labkit import theory
from labkit.theory.planner import audit
from labkit.theory.planner.playbook import PLAYBOOK, TOP, nanotron_flops_per_token, place, sweep_plans

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from published import stamp, write_results  # noqa: E402  (the published table's stamp and writer)

HERE = os.path.dirname(os.path.abspath(__file__))


def rows() -> list[dict]:
    out = []
    for run, e in zip(PLAYBOOK, audit.errors(PLAYBOOK)):
        plan = theory.evaluate(run.config, run.model_config, "h100", stack=run.stack)
        mfu = plan.tokens_per_second_per_gpu * nanotron_flops_per_token(run.model) / 989e12
        r = {"run": run, "error": e, "mfu": mfu, "plan": plan}
        r["allocated"], r["reserved"] = (plan.memory[k] / 2**30 for k in ("allocated", "reserved"))
        r["sweep"] = place(run, plan, sweep_plans(run))
        free = theory.plan(
            run.model_config, run.config.world, "h100", run.config.global_batch, TOP, "bf16", stack=run.stack
        )
        r["free"] = place(run, plan, list(free))
        r["best"] = free[0].layout() if free else "nothing fits"
        out.append(r)
        print(line(r), flush=True)
    return out


def line(r: dict) -> str:
    run, e = r["run"], r["error"]
    ok = lambda b: "" if b else " ✗"  # noqa: E731
    (sp, sr), (fp, fr) = r["sweep"], r["free"]
    cell = run.name.removeprefix("Playbook ")
    return (
        f"| {cell} | {r['mfu']:.1%} | {run.mfu:.1%} | {e.speed_error:+.0%}{ok(e.speed_within)} "
        f"| {r['allocated']:.1f} | {run.memory_gib:.1f} | {e.memory_error:+.0%}{ok(e.memory_within)} "
        f"| {r['reserved'] / run.memory_gib - 1:+.0%} | {r['plan'].bound} "
        f"| {sp or '>5'} | {sr:.2f} | {fp or '>5'} | {fr:.2f} |"
    )


def table(rs: list[dict], seconds: float) -> list[str]:
    c = audit.counts([r["error"] for r in rs])
    speed = sorted(abs(r["error"].speed_error) for r in rs)
    sweep_ok = sum(1 for r in rs if r["sweep"][0] is not None or r["sweep"][1] >= 0.9)
    free_ok = sum(1 for r in rs if r["free"][0] is not None or r["free"][1] >= 0.9)
    mean = sum(r["error"].speed_error for r in rs) / len(rs)
    return [
        f"Measured {stamp()} ({seconds:.0f} s). MFU as nanotron counts it (attention's square whole, the LM head, "
        "x3) over 989 TFLOP/s; memory as max_memory_allocated (GiB); the reserved error beside it.",
        "",
        "| cell | MFU predicted | Playbook | error | allocated GiB predicted | Playbook | error | reserved error "
        "| bound | place (sweep) | vs best | place (free) | vs best |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        *(line(r) for r in rs),
        "",
        f"MFU within {audit.SPEED_OK:.0%}: {c['speed all'][0]}/{c['speed all'][1]} (mean error {mean:+.0%}, median "
        f"|error| {speed[len(speed) // 2]:.0%}); memory within {audit.MEMORY_OK:.0%}: "
        f"{c['memory all'][0]}/{c['memory all'][1]}.",
        f"The Playbook's layout in the planner's top {TOP} or within 10% of its best: {sweep_ok}/{len(rs)} over the "
        f"sweep's space, {free_ok}/{len(rs)} unrestricted (bf16).",
    ]


def write(path: str, lines: list[str], block: str, once: bool) -> None:
    """The block between its markers in RESULTS.md (appended the first time); `once`: never replaced."""
    begin, end = f"<!-- playbook.py {block} begin -->", f"<!-- playbook.py {block} end -->"
    if not write_results(path, lines, begin, end, once):
        print(f"{block} block already in {path}: kept as it is")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="where the table goes ('' for none)")
    ap.add_argument("--blind", action="store_true", help="write the first prediction's block (once)")
    ns = ap.parse_args(argv)
    t0 = time.perf_counter()
    lines = table(rows(), time.perf_counter() - t0)
    print("\n".join(lines[-3:]))
    if ns.out:
        write(ns.out, lines, "blind" if ns.blind else "latest", once=ns.blind)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
