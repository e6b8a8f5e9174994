"""Foundation numbers from one run: cluster start, a warm re-run, and our DDP vs PyTorch's.

    python benchmarks/foundation.py            # 4 CPU engines, the default model

Step times are medians (over ranks, and over 5 interleaved A/B repeats of 6 steps, the first
step of each run dropped as warm-up).
"""

from __future__ import annotations

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import ab, machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig  # noqa: E402


def main() -> None:
    model = ModelConfig()
    t0 = time.perf_counter()
    lab = Lab(engines=4, progress=False)
    start = time.perf_counter() - t0
    try:
        lab.run(ParallelConfig(dp=4), model=model, steps=2)
        t0 = time.perf_counter()
        lab.run(ParallelConfig(dp=2, microbatches=2), model=model, steps=3)
        warm = time.perf_counter() - t0
        med = ab(
            lab,
            {"lab": ParallelConfig(dp=4, impl="lab"), "torch": ParallelConfig(dp=4, impl="torch")},
            model,
            repeats=5,
            steps=6,
        )
    finally:
        lab.close()
    print(f"machine: {machine()}")
    print(
        table(
            [
                ("cluster start (4 engines)", f"{start:.1f} s"),
                ("warm re-run, changed layout, 3 steps", f"{warm:.2f} s"),
                ("DDP step, ours", f"{med['lab'] * 1e3:.1f} ms"),
                ("DDP step, PyTorch", f"{med['torch'] * 1e3:.1f} ms"),
                ("ours / PyTorch", f"{med['lab'] / med['torch']:.2f}"),
            ]
        )
    )


if __name__ == "__main__":
    main()
