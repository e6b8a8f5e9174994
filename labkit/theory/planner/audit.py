"""The planner held to the published runs, with a check that can fail.

Every row of theory/planner/published.py priced by theory.evaluate, its predicted / published
ratio of tokens/s/GPU and (where the source publishes it) of memory per GPU; the ratios pinned in
a table in the repository (benchmarks/data/published_errors.csv, written by
`python benchmarks/published.py --pin`); `pin_problems` names every row whose error grew by more
than GROWTH (5 points) against the pinned table, and every count within tolerance that dropped.

A row outside the tolerances is a miss in every count, whatever terms it names as unpriced
(Run.unpriced): a named term explains a miss, it never turns it into a hit.

    rows = audit.errors(RUNS)                          # the model as it is
    rows = audit.errors(RUNS, scale=0.5)               # every FLOP and byte rate halved
    problems = audit.pin_problems(rows, audit.read_pin())

The pinned table is re-written only in a commit that says which modelling change moved which rows
and why (a recalibration from a new measurement is such a change; tuning to the rows is not).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from dataclasses import dataclass

from labkit.theory.planner import measured
from labkit.theory.planner.evaluate import evaluate
from labkit.theory.planner.hardware import Hardware, Link, hardware_of
from labkit.theory.planner.playbook import PLAYBOOK
from labkit.theory.planner.published import RUNS

SPEED_OK, MEMORY_OK = 0.25, 0.15
"""The issue's tolerances: tokens/s/GPU within 25%, memory within 15%."""
GROWTH = 0.05
"""How far a row's error may grow against the pinned table before the check fails (5 points)."""
GiB = 2**30
PIN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "data", "published_errors.csv")
"""The pinned table, in the repository beside the benchmarks (labkit is installed editable from its checkout)."""
COLUMNS = ("run", "source", "today", "speed_ratio", "memory_ratio")
ALL = RUNS + PLAYBOOK
"""Every row the planner is held to: torchtitan's, llm-foundry's, the steps measured here, the Playbook's."""


@dataclass(frozen=True)
class RowError:
    """One published row against its prediction."""

    run: str
    source: str
    today: bool
    """Run on today's software (torchtitan, the Playbook, the steps measured here), not llm-foundry's 2023 stack."""
    speed_ratio: float
    """Predicted over published tokens/s/GPU (the same as published over predicted step time)."""
    memory_ratio: float | None
    """Predicted over published memory per GPU, in the source's own statistic; None where none is published."""

    @property
    def speed_error(self) -> float:
        return self.speed_ratio - 1

    @property
    def memory_error(self) -> float | None:
        return None if self.memory_ratio is None else self.memory_ratio - 1

    @property
    def speed_within(self) -> bool:
        return abs(self.speed_error) <= SPEED_OK

    @property
    def memory_within(self) -> bool | None:
        return None if self.memory_ratio is None else abs(self.memory_error) <= MEMORY_OK


def scaled(hw: Hardware, k: float) -> Hardware:
    """`hw` with every FLOP and byte rate times k: the peaks (bf16, fp8), HBM, and both links'
    bandwidth (the latencies stay: they are not rates). The check's own test: a model whose rates
    are all off by 2x must fail it."""
    return dataclasses.replace(
        hw,
        flops=hw.flops * k,
        fp8_flops=hw.fp8_flops * k,
        hbm=hw.hbm * k,
        intra=Link(hw.intra.alpha, hw.intra.beta * k),
        inter=Link(hw.inter.alpha, hw.inter.beta * k),
    )


def predicted_memory(run, plan) -> float:
    """The prediction in the statistic the source published, GiB: torch.cuda.max_memory_reserved
    (torchtitan, the steps here) or max_memory_allocated, never with the CUDA context."""
    key = "allocated" if run.memory_stat == "allocated" else "reserved"
    return plan.memory[key] / GiB


def errors(runs, scale: float = 1.0) -> list[RowError]:
    """Every run priced (its hardware's rates times `scale`) against what it published."""
    out = []
    for run in runs:
        hw = hardware_of(run.hardware)
        plan = evaluate(run.config, run.model_config, scaled(hw, scale) if scale != 1.0 else hw, stack=run.stack)
        memory = None if run.memory_gib is None else predicted_memory(run, plan) / run.memory_gib
        speed = plan.tokens_per_second_per_gpu / run.tokens_per_second_per_gpu
        out.append(RowError(run.name, run.family, run.today, speed, memory))
    return out


def counts(rows: list[RowError]) -> dict[str, tuple[int, int]]:
    """(within, of) for speed and memory, over every row and over today's software."""
    out = {}
    for label, subset in (("all", rows), ("today", [r for r in rows if r.today])):
        memory = [r for r in subset if r.memory_ratio is not None]
        out[f"speed {label}"] = (sum(r.speed_within for r in subset), len(subset))
        out[f"memory {label}"] = (sum(bool(r.memory_within) for r in memory), len(memory))
    return out


def pin_problems(rows: list[RowError], pinned: list[RowError]) -> list[str]:
    """What moved against the pinned table: a row's error grown by more than GROWTH (speed or
    memory), a count within tolerance that dropped, a row added or gone."""
    now, then = {r.run: r for r in rows}, {r.run: r for r in pinned}
    found = [
        f"{name}: not in the pinned table (re-pin it in the commit that adds the row)" for name in now.keys() - then
    ]
    found += [f"{name}: in the pinned table but no longer a row" for name in then.keys() - now]
    for name in now.keys() & then.keys():
        a, b = now[name], then[name]
        if abs(a.speed_error) > abs(b.speed_error) + GROWTH:
            found.append(f"{name}: tokens/s/GPU error {a.speed_error:+.1%}, pinned {b.speed_error:+.1%}")
        if a.memory_ratio is not None and b.memory_ratio is not None:
            if abs(a.memory_error) > abs(b.memory_error) + GROWTH:
                found.append(f"{name}: memory error {a.memory_error:+.1%}, pinned {b.memory_error:+.1%}")
    got, want = counts(rows), counts(pinned)
    for key, (n, of) in got.items():
        if n < want[key][0]:
            found.append(f"{key}: {n}/{of} within tolerance, pinned {want[key][0]}/{want[key][1]}")
    return sorted(found)


def write_pin(rows: list[RowError], header: str, path: str = PIN) -> None:
    """The table, one row per run, under a comment line naming the commit that wrote it."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows:
        memory = "" if r.memory_ratio is None else f"{r.memory_ratio:.4f}"
        w.writerow((r.run, r.source, int(r.today), f"{r.speed_ratio:.4f}", memory))
    with open(path, "w") as f:
        f.write(f"# {header}\n" + buf.getvalue())


def read_pin(path: str = PIN) -> list[RowError]:
    with open(path) as f:
        lines = [line for line in f if not line.startswith("#")]
    out = []
    for row in csv.DictReader(lines):
        memory = float(row["memory_ratio"]) if row["memory_ratio"] else None
        out.append(RowError(row["run"], row["source"], row["today"] == "1", float(row["speed_ratio"]), memory))
    return out


def judged_shapes() -> set[tuple]:
    """(layers, hidden, vocab, sequences per data-parallel replica, seq) of every row the planner is
    judged on: what a calibration point (theory/planner/measured.py) may never be."""
    out = set()
    for run in ALL:
        m, cfg = run.model_config, run.config
        out.add((m.layers, m.hidden, m.vocab, cfg.global_batch // cfg.dp, m.seq))
    return out


def calibration_problems(path: str | None = None) -> list[str]:
    """What makes the planner's measurement file unusable (default measured.PATH), a validation row used as a
    calibration point included."""
    path = path or measured.PATH
    with open(path) as f:
        data = json.load(f)
    return measured.problems(data, os.path.basename(path), judged_shapes())
