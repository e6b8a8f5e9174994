"""The per-stage size at which a pipeline's compute dominates its point-to-point latency, here.

    python benchmarks/stage_size.py          # 4 CPU engines, one Lab, ~3 minutes on 2 cores

Notebook 05 teaches the bubble; on 4 gloo engines sharing 2 cores a stage too small computes
for less time than one send/recv takes, and the timeline shows waits, not the schedule. This
sweeps the blocks' width (8 blocks, m=8) and prints, per size and pp, the mean forward span
t_F, a message's latency (the median send span: posting it, gloo moving it, the receiver taking
it), their ratio, and the bubble measured against the one simulated from the run's own F/B/W costs for 1F1B, ZB-H1
and interleaved 1F1B (v=2): the notebook takes the smallest size where t_F >> t_comm and every
measured bubble is within 0.10 of its simulation. pp=4 puts two stages on each core, which the
simulator (one processor per stage) does not model; pp=2 gives each stage a core.
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig  # noqa: E402
from labkit.theory.exact.pipeline import costs_from_result, simulated  # noqa: E402

STEPS = 4


def layouts(pp: int) -> dict[str, ParallelConfig]:
    base = ParallelConfig(pp=pp, microbatches=8, global_batch=16)
    return {
        "1f1b": base.replace(schedule="1f1b"),
        "zbh1": base.replace(schedule="zbh1"),
        "interleaved": base.replace(schedule="interleaved", virtual_stages=2),
    }


def model_of(hidden: int, seq: int) -> ModelConfig:
    return ModelConfig(layers=8, hidden=hidden, heads=4, ffn=4 * hidden, vocab=128, seq=seq)


def mean_of(per_rank) -> float:
    return statistics.mean(per_rank.values()) if isinstance(per_rank, dict) else per_rank


def measure(lab, model: ModelConfig, pp: int) -> tuple[str, str]:
    cells, f_ms, comm_ms = [], 0.0, 0.0
    for name, cfg in layouts(pp).items():
        res = lab.run(cfg, model=model, steps=STEPS)
        gaps = []
        for s in range(1, STEPS):  # the first step warms up
            costs = costs_from_result(res, s)
            gaps.append((res.bubble_fraction(s)["overall"], simulated(cfg, costs).bubble))
            if name == "1f1b":
                f_ms = mean_of(costs["F"]) * 1e3
        if name == "1f1b":
            comm_ms = (
                statistics.median(e.end - e.start for rk in res.ranks for e in rk.timeline if e.kind == "send") * 1e3
            )
        meas, sim = (statistics.median(g[i] for g in gaps) for i in (0, 1))
        cells.append(f"{name} {meas:.2f}/{sim:.2f}")
    label = f"pp={pp} hidden={model.hidden:<4} seq={model.seq:<3}"
    ratio = f_ms / comm_ms if comm_ms else float("inf")
    return label, f"t_F {f_ms:6.2f} ms  message {comm_ms:5.2f} ms  ratio {ratio:5.1f} | " + "  ".join(cells)


def main() -> None:
    rows = []
    with Lab(engines=4, progress=False) as lab:
        for pp in (2, 4):
            for hidden, seq in ((32, 16), (128, 64), (256, 64), (256, 128)):
                rows.append(measure(lab, model_of(hidden, seq), pp))
                print(*rows[-1], flush=True)
    print(f"\nmachine: {machine()}\nbubble measured/simulated(measured costs), median over steps 1..{STEPS - 1}")
    print(table(rows))


if __name__ == "__main__":
    main()
