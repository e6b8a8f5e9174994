"""What the per-op checkpointing policy costs the host: the CPU seconds to issue one Llama step's
forward and backward with no checkpointing, full, and torchtitan's per-op policy, at widths so
small that every kernel is trivial (what is left is Python, the dispatcher and autograd, as on
the host of a GPU whose kernels run asynchronously). It tests one explanation of the published
rows the planner misses with the per-op policy (labkit/theory/planner/published.py OP_POLICY): a step
whose host time stays below its GPU time hides that cost entirely.

    python benchmarks/op_policy_host.py     # about a minute on one core; prints a table

The block is benchmarks/gpu_constants.py's torchtitan-style Llama block, under its policy.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from gpu_constants import Block, checkpointed
from torch.utils._python_dispatch import TorchDispatchMode

WIDTH = dict(h=64, heads=4, kv=2, f=128)
SEQ, BATCH = 16, 1
GPU_STEPS = {  # layers, and the GPU step seconds (measured, or published tokens over tokens/s)
    "Llama 1.5B here, 2 x 4096 (H100, measured: none / full / op)": (16, (0.2141, 0.2581, 0.2953)),
    "Llama 3.1 8B, 2 x 8192 per GPU (torchtitan table 1, op)": (32, (None, None, 16384 / 5762)),
}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def host_seconds(layers: int, mode: str, repeats: int = 15) -> tuple[float, int]:
    """Median seconds of one forward + backward through `layers` blocks, and its aten calls."""
    torch.manual_seed(0)
    blocks = [Block(**WIDTH).to(torch.bfloat16) for _ in range(layers)]
    for block in blocks:
        if mode != "none":
            checkpointed(block, mode)
    hd = WIDTH["h"] // WIDTH["heads"]
    freqs = torch.polar(torch.ones(SEQ, hd // 2), torch.randn(SEQ, hd // 2))
    x0 = torch.randn(BATCH, SEQ, WIDTH["h"], dtype=torch.bfloat16, requires_grad=True)

    def step():
        x = x0
        for block in blocks:
            x = block(x, freqs)
        x.float().sum().backward()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    count = _Count()
    with count:
        step()
    return statistics.median(times), count.n


def main() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread; blocks of width {WIDTH['h']}, {BATCH} x {SEQ} tokens")
    print("| step | layers | mode | host ms / step | aten calls | µs / call | GPU ms / step | host / GPU |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (layers, gpu) in GPU_STEPS.items():
        for mode, gpu_s in zip(("none", "full", "op"), gpu):
            t, calls = host_seconds(layers, mode)
            g = f"{gpu_s * 1e3:,.0f} | {t / gpu_s:.2f}" if gpu_s else "— | —"
            print(f"| {name} | {layers} | {mode} | {t * 1e3:.1f} | {calls} | {t / calls * 1e6:.1f} | {g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
