"""Helpers for the benchmarks: medians of step times, A/B interleaving, a plain table."""

from __future__ import annotations

import platform
import statistics


def machine() -> str:
    import os

    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )


def steady_step_time(result) -> float:
    """Median over ranks of each rank's median step time, skipping the first (warm-up) step."""
    per_rank = [statistics.median(rk.step_times[1:] or rk.step_times) for rk in result.ranks]
    return statistics.median(per_rank)


def ab(lab, configs: dict, model, repeats: int, steps: int) -> dict[str, float]:
    """Run each named config `repeats` times, interleaved (A B A B ...); median step time of each."""
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, cfg in configs.items():
            times[name].append(steady_step_time(lab.run(cfg, model=model, steps=steps, progress=False)))
    return {name: statistics.median(ts) for name, ts in times.items()}


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
