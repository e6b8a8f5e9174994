"""Tensor and sequence parallelism on the default model: bytes per layer per collective, memory
per rank, and step times of ours vs DTensor's.

    python benchmarks/tensor.py            # 4 CPU engines, ModelConfig(), global batch 8

Bytes and memory come from one run each (they do not vary), with the theory beside them.
Step times are medians over ranks and over interleaved repeats (A B A B ...), the first step of
each run dropped as warm-up; on a shared 2-core machine they are noisy, so read ratios only.
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import ab, machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig, theory  # noqa: E402
from labkit.theory.exact import tensor as tp_theory  # noqa: E402

KIB = 1024


def comm_by_op(res, rank: int = 0, step: int = -1) -> dict[str, tuple[int, float]]:
    """(calls, wire bytes) per dim/op on one rank in the last step."""
    return {f"{r['dim']}/{r['op']}": (r["calls"], r["wire_bytes"]) for r in res.comm_table(step) if r["rank"] == rank}


def main(repeats: int = 5, steps: int = 6) -> None:
    model = ModelConfig()
    lines: list[tuple[str, str]] = []
    layouts = {
        "dp2": ParallelConfig(dp=2),
        "tp2": ParallelConfig(tp=2),
        "tp2+sp": ParallelConfig(tp=2, sequence_parallel=True),
        "tp2 torch": ParallelConfig(tp=2, impl="torch"),
        "tp2+sp torch": ParallelConfig(tp=2, sequence_parallel=True, impl="torch"),
        "dp4": ParallelConfig(dp=4),
        "tp4": ParallelConfig(tp=4),
        "tp4+sp": ParallelConfig(tp=4, sequence_parallel=True),
        "tp2 x dp2": ParallelConfig(tp=2, dp=2),
    }
    with Lab(engines=4, progress=False) as lab:
        runs = {name: lab.run(cfg, model=model, steps=3) for name, cfg in layouts.items()}
        t0 = time.perf_counter()
        times = ab(
            lab,
            {k: layouts[k] for k in ("tp2", "tp2 torch", "tp2+sp", "tp2+sp torch")},
            model,
            repeats=repeats,
            steps=steps,
        )
        times.update(
            ab(lab, {k: layouts[k] for k in ("tp4", "tp4+sp", "dp4", "tp2 x dp2")}, model, repeats=repeats, steps=steps)
        )
        bench_s = time.perf_counter() - t0

    print(f"machine: {machine()}")
    print(f"model: {model}, global batch 8 (b = 8 per tp group), fp32\n")

    print("Payload per transformer layer per microbatch (forward + backward), theory:")
    for name in ("tp2", "tp2+sp"):
        per = tp_theory.per_layer(layouts[name], model)
        print(f"  {name:8s} " + ", ".join(f"{op} {b / KIB:.0f} KiB" for op, b in per.items()))
    print("\nCollectives per step on rank 0 (calls, ring-model wire KiB sent), measured [= theory for ours]:")
    for name, res in runs.items():
        est = theory.estimate(layouts[name], model, world=4)
        same = "=" if layouts[name].impl == "lab" and res.comm_table() == est.comm_table() else " "
        if layouts[name].impl == "torch":
            same = "(DTensor)"
        rows = ", ".join(f"{k} {c}x {w / KIB:.1f}" for k, (c, w) in comm_by_op(res).items())
        print(f"  {name:13s} {same:9s} {rows}")

    print("\nMemory per rank (rank 0, KiB): params / grads / optimizer / activations (theory) / peak")
    for name, res in runs.items():
        m = res.ranks[0].memory
        est = theory.estimate(layouts[name], model, world=4).memory[0]
        print(
            f"  {name:13s} {m['params'] / KIB:7.1f} {m['grads'] / KIB:7.1f} {m['optimizer'] / KIB:7.1f} "
            f"{m['activations'] / KIB:8.1f} ({est['activations'] / KIB:.1f}) {m['peak'] / KIB:8.1f}"
        )

    print(f"\nStep time, median of {repeats} interleaved runs x {steps - 1} steps ({bench_s:.0f} s):")
    for k, v in times.items():
        lines.append((k, f"{v * 1e3:.1f} ms"))
    lines.append(("ours / DTensor, tp2", f"{times['tp2'] / times['tp2 torch']:.2f}"))
    lines.append(("ours / DTensor, tp2+sp", f"{times['tp2+sp'] / times['tp2+sp torch']:.2f}"))
    print(table(lines))


if __name__ == "__main__":
    main()
