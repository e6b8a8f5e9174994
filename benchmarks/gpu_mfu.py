"""Model FLOPs utilisation of a GPT-2-small bf16 step on one GPU, with every meter on.

    python benchmarks/gpu_mfu.py        # on a machine with a CUDA GPU

MFU = 6·Ψ·tokens / (step seconds · peak), where the peak is this device's own measured bf16
matrix-multiply rate (an 8192³ product, median of 10 after warm-up), not the datasheet's.
"""

from __future__ import annotations

import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, steady_step_time, table  # noqa: E402


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def main() -> None:
    from labkit import Lab, ParallelConfig, theory
    from labkit.theory.presets import GPT2_124M

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    peak = matmul_peak()
    model = GPT2_124M
    cfg = ParallelConfig(dp=1, global_batch=16, precision="bf16")
    with Lab(engines=1, progress=False) as lab:
        res = lab.run(cfg, model=model, steps=8)
    step = steady_step_time(res)
    tokens = cfg.global_batch * model.seq
    flops = 6 * theory.num_params(model) * tokens
    print(f"machine: {machine()}, {torch.cuda.get_device_name()}")
    print(
        table(
            [
                ("measured bf16 matmul peak", f"{peak / 1e12:.0f} TFLOP/s"),
                ("GPT-2 124M (untied head) step, 16 x 1024 tokens", f"{step * 1e3:.1f} ms"),
                ("model FLOPs per step (6·Ψ·tokens)", f"{flops / 1e12:.2f} TFLOP"),
                ("MFU against the measured peak", f"{flops / step / peak:.1%}"),
                ("allocator peak", f"{res.ranks[0].memory['peak'] / 2**30:.2f} GiB"),
            ]
        )
    )


if __name__ == "__main__":
    main()
