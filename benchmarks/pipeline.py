"""Pipeline numbers: measured vs predicted bubble, step times of ours vs torch's schedules,
activation peaks per stage (GPipe vs 1F1B).

    python benchmarks/pipeline.py            # 4 CPU engines

Bubble: RunResult.bubble_fraction (idle share of each rank between its pipeline's first and
last compute span; mean over ranks), the median over the steps after the first; predicted:
(p-1)/(v·m+p-1), the zero-bubble schedules' the simulator's with unit costs (theory.estimate);
simulated: the same schedule replayed with the run's own mean t_F, t_B (t_W) per stage and its
fastest receive as t_comm. Step times: medians over ranks and over interleaved
A/B repeats, the first step of each run dropped.
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, steady_step_time, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig, theory  # noqa: E402
from labkit.theory.exact.pipeline import costs_from_result, simulated  # noqa: E402

MODEL = ModelConfig(layers=8, hidden=128, heads=4, ffn=512, vocab=256, seq=64)
STEPS = 4


def layouts():
    for pp in (2, 4):
        for m in (4, 8):
            for sched in ("gpipe", "1f1b"):
                yield ParallelConfig(pp=pp, microbatches=m, schedule=sched, global_batch=16)
        yield ParallelConfig(pp=pp, microbatches=8, schedule="interleaved", virtual_stages=2, global_batch=16)
        yield ParallelConfig(pp=pp, microbatches=8, schedule="zbh1", global_batch=16)
        for sched in ("zbv", "dualpipev"):  # two chunks per rank in a V
            yield ParallelConfig(pp=pp, microbatches=8, schedule=sched, virtual_stages=2, global_batch=16)


def concurrency(res, step: int) -> tuple[float, float]:
    """Mean forward time of the first stage when it computes alone vs when >= 3 ranks compute."""
    spans = [(rk.rank, e) for rk in res.ranks for e in rk.timeline if e.step == step and e.kind in ("F", "B")]
    alone, crowded = [], []
    for r, e in spans:
        if e.kind != "F" or res.ranks[r].coords["pp"] != 0:
            continue
        mid = (e.start + e.end) / 2
        busy = sum(1 for _, o in spans if o.start <= mid <= o.end)
        (alone if busy == 1 else crowded if busy >= 3 else []).append(e.end - e.start)
    mean = lambda xs: statistics.mean(xs) * 1e3 if xs else float("nan")  # noqa: E731
    return mean(alone), mean(crowded)


def main() -> None:
    rows = []
    with Lab(engines=4, progress=False) as lab:
        for cfg in layouts():
            times = {}
            for impl in ("lab", "torch", "lab", "torch"):  # A B A B
                c = cfg.replace(impl=impl)
                res = lab.run(c, model=MODEL, steps=STEPS)
                times.setdefault(impl, []).append(steady_step_time(res))
                if impl == "lab":
                    ours = res
            bub = statistics.median(ours.bubble_fraction(s)["overall"] for s in range(1, STEPS))
            pred = theory.estimate(cfg, MODEL).bubble
            sim = simulated(cfg, costs_from_result(ours)).bubble
            by_stage = sorted(ours.ranks, key=lambda r: r.coords["pp"])
            acts = [rk.memory["activations"] for rk in by_stage]
            est = theory.estimate(cfg, MODEL)
            alone, crowded = concurrency(ours, STEPS - 1)
            name = f"pp={cfg.pp} {cfg.schedule:<11} m={cfg.microbatches}"
            rows.append(
                (
                    name,
                    f"bubble measured {bub:.2f}  predicted {pred:.2f}  simulated(measured costs) {sim:.2f}"
                    f" | step ours {statistics.median(times['lab']) * 1e3:6.1f} ms  torch "
                    f"{statistics.median(times['torch']) * 1e3:6.1f} ms"
                    f" | act KiB/stage {[a // 1024 for a in acts]} (theory "
                    f"{[est.memory[rk.rank]['activations'] // 1024 for rk in by_stage]})"
                    f" | F on stage 0 alone {alone:.1f} ms, with >=3 busy {crowded:.1f} ms",
                )
            )
            print(rows[-1][0], rows[-1][1], flush=True)
    print(f"\nmachine: {machine()}\nmodel: {MODEL}, global_batch 16, {STEPS} steps")
    print(table(rows))


if __name__ == "__main__":
    main()
