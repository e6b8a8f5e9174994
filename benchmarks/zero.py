"""Sharded data parallelism from one run: step time and memory per rank of DDP, ZeRO-1/2/3 and
FSDP (ours and PyTorch's FSDP2), fp32 and bf16, on 4 engines with the default ModelConfig().

    python benchmarks/zero.py

Step times are medians (over ranks, and over 5 interleaved repeats of 6 steps, the first step
of each run dropped as warm-up). Memory is rank 0's report in KiB (every rank holds the same
here): persistent states after the step, the peak of activations, of gathered parameters and
of reduce buffers, and the peak of their sum over the step as the meters saw it. On the CPU
there is no allocator peak: FSDP2's internal all-gather and reduce-scatter buffers are not
tracked, so its peak leaves them out; ours counts its reduce buffers.
"""

from __future__ import annotations

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import ab, machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig, theory  # noqa: E402

CONFIGS = {
    "DDP (ours)": dict(),
    "ZeRO-1": dict(sharding="zero1"),
    "ZeRO-2": dict(sharding="zero2"),
    "ZeRO-3": dict(sharding="zero3"),
    "FSDP (ours)": dict(sharding="fsdp"),
    "FSDP2 (PyTorch)": dict(sharding="fsdp", impl="torch"),
    "FSDP, no reshard (ours)": dict(sharding="fsdp", reshard_after_forward=False),
    "FSDP2, no reshard (PyTorch)": dict(sharding="fsdp", impl="torch", reshard_after_forward=False),
}
COLUMNS = ("params", "grads", "optimizer", "activations", "gathered", "reduce_buffers", "peak")


def kib(n) -> str:
    return f"{n / 1024:8.1f}"


def main() -> None:
    model = ModelConfig()
    configs = {
        f"{name} {prec}": ParallelConfig(dp=4, precision=prec, **kw)
        for prec in ("fp32", "bf16")
        for name, kw in CONFIGS.items()
    }
    with Lab(engines=4, progress=False) as lab:
        memory = {name: lab.run(cfg, model=model, steps=2).ranks[0].memory for name, cfg in configs.items()}
        med = ab(lab, configs, model, repeats=5, steps=6)
    psi = theory.num_params(model)
    print(f"machine: {machine()}")
    print(f"model: ModelConfig() = {psi:,} parameters (Ψ); dp = 4; memory of rank 0 in KiB")
    head = f"{'layout':<34}{'step ms':>8}" + "".join(f"{c:>15}" for c in COLUMNS) + "  = theory"
    print(head)
    for name, cfg in configs.items():
        m = memory[name]
        est = theory.estimate(cfg, model).memory[0]
        exact = all(m.get(k, 0) == est.get(k, 0) for k in COLUMNS if k != "peak")
        print(
            f"{name:<34}{med[name] * 1e3:8.1f}"
            + "".join(f"{kib(m.get(c, 0)):>15}" for c in COLUMNS)
            + f"  {'yes' if exact else 'NO'}"
        )
    for prec in ("fp32", "bf16"):
        ours, torch = med[f"ZeRO-3 {prec}"], med[f"FSDP2 (PyTorch) {prec}"]
        fsdp = med[f"FSDP (ours) {prec}"]
        print(
            table(
                [
                    (f"{prec}: ZeRO-3 / FSDP2 step time", f"{ours / torch:.2f}"),
                    (f"{prec}: FSDP (ours) / FSDP2 step time", f"{fsdp / torch:.2f}"),
                ]
            )
        )


if __name__ == "__main__":
    main()
