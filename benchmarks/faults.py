"""What the collective log costs: step time with it (the default) and without, on the default model.

    python benchmarks/faults.py            # 4 CPU engines, ModelConfig(), DDP (dp=4)

The log is the comm meter (engines/meters/comm.py) running for the whole job; "without" runs
with Lab.run(_comm_log=False), which unregisters the meter's dispatcher kernels for that job,
so no collective passes through Python at all. Step times are medians over ranks and over
interleaved A/B repeats (the first step of each run dropped as warm-up).
"""

from __future__ import annotations

import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, steady_step_time, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig  # noqa: E402


def _per_collective(blocks: int = 20, n: int = 200) -> dict:
    """Seconds per 1-element all-reduce among the ranks, the log switched on and off in
    alternating blocks inside one job (so both see the same machine load)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from labkit.engines.meters import comm

    meter = comm.CommMeter.current  # the job's collective log
    t = torch.ones(1)
    out = {True: [], False: []}
    for b in range(blocks):
        log = b % 2 == 0
        if log:
            comm.install()
            comm.CommMeter.current = meter
        else:
            comm.CommMeter.current = None
            comm.uninstall()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        out[log].append((time.perf_counter() - t0) / n)
    comm.install()
    return {k: statistics.median(v) for k, v in out.items()}


def main(repeats: int = 9, steps: int = 8) -> None:
    model, cfg = ModelConfig(), ParallelConfig(dp=4)
    times: dict[bool, list[float]] = {True: [], False: []}
    with Lab(engines=4, progress=False) as lab:
        lab.run(cfg, model=model, steps=2)  # warm: groups built, kernels compiled
        for _ in range(repeats):
            for log in (True, False):
                res = lab.run(cfg, model=model, steps=steps, _comm_log=log)
                assert bool(res.ranks[0].comm) == log
                times[log].append(steady_step_time(res))
        with_log = lab.run(cfg, model=model, steps=3)
        ops = sum(1 for e in with_log.ranks[0].comm if e.step == 2)
        got = lab.apply(_per_collective)
        per_op = {log: statistics.median(g[log] for g in got) for log in (True, False)}
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"machine: {machine()}")
    print(
        table(
            [
                ("step, collective log on (default)", f"{on * 1e3:.2f} ms"),
                ("step, collective log off", f"{off * 1e3:.2f} ms"),
                ("overhead", f"{(on / off - 1) * 100:+.1f} %"),
                ("collectives per step (rank 0)", f"{ops}"),
                ("1-element all-reduce, log on / off", f"{per_op[True] * 1e6:.1f} / {per_op[False] * 1e6:.1f} us"),
                (
                    "log cost per step from that",
                    f"{ops * (per_op[True] - per_op[False]) * 1e6:.1f} us = "
                    f"{ops * (per_op[True] - per_op[False]) / off * 100:.2f} % of a step",
                ),
                (
                    "per-repeat overhead (%)",
                    " ".join(f"{(a / b - 1) * 100:+.1f}" for a, b in zip(times[True], times[False])),
                ),
            ]
        )
    )


if __name__ == "__main__":
    main()
