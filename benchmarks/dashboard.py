"""Dashboard latency: a control change -> every figure redrawn, on 4 CPU engines, default model.

    python benchmarks/dashboard.py

Each change sets a control as a person would (`dash.controls[...].value = ...`) and waits until
the run and the redraw of all six figures are done (`dash.wait()`). Reported: the median over
10 changes of that latency, and its parts as the dashboard timed them (debounce, run on the
cluster, one-process reference for the loss figure, building and showing the figures).
Target: under 1 s.
"""

from __future__ import annotations

import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, table  # noqa: E402

from labkit import Lab, ModelConfig  # noqa: E402
from labkit.widgets import Dashboard  # noqa: E402

CHANGES = [("dp", 2), ("dp", 4)] * 3 + [
    ("microbatches", 2),
    ("microbatches", 1),
    ("bucket_mb", 1.0),
    ("bucket_mb", 25.0),
]


def latency(lab, model, changes=CHANGES) -> tuple[list[float], list[dict]]:
    """Seconds from each control change to all figures redrawn, and the dashboard's own parts."""
    dash = Dashboard(lab, model=model)
    try:
        dash.wait(300)  # the first run warms the engines up
        dash.controls["dp"].value = 2  # and one more, so every layout below is warm
        dash.wait(120)
        dash.controls["dp"].value = 4
        dash.wait(120)
        total, parts = [], []
        for field, value in changes:
            t0 = time.perf_counter()
            dash.controls[field].value = value
            dash.wait(120)
            total.append(time.perf_counter() - t0)
            parts.append(dict(dash.timings))
            assert getattr(dash.result.config, field) == value and dash.error is None
    finally:
        dash.close()
    return total, parts


def main() -> None:
    model = ModelConfig()
    with Lab(engines=4, progress=False) as lab:
        total, parts = latency(lab, model)
    med = lambda k: statistics.median(p[k] for p in parts)  # noqa: E731
    print(f"machine: {machine()}")
    print(
        table(
            [
                ("changes", f"{len(CHANGES)} ({', '.join(f'{f}={v}' for f, v in CHANGES)})"),
                ("control change -> 6 figures redrawn, median", f"{statistics.median(total) * 1e3:.0f} ms"),
                ("  min / max", f"{min(total) * 1e3:.0f} / {max(total) * 1e3:.0f} ms"),
                ("  debounce + queue (median)", f"{med('debounce_and_queue') * 1e3:.0f} ms"),
                ("  run, 3 steps on the cluster (median)", f"{med('run') * 1e3:.0f} ms"),
                ("  reference, cached per batch (median)", f"{med('reference') * 1e3:.0f} ms"),
                ("  figures built and shown (median)", f"{med('figures') * 1e3:.0f} ms"),
                ("target", "< 1000 ms"),
            ]
        )
    )


if __name__ == "__main__":
    main()
