"""dry_run: measure one rank of a full-size layout without a cluster, and hold it against theory.

    d = labkit.dry_run(ParallelConfig(dp=32, tp=8, pp=4, microbatches=8, global_batch=256),
                       presets.LLAMA_70B, rank=0)
    d.report.memory      # measured bytes: params, grads, optimizer, activations
    d.comm_table()       # measured rows of that rank, one step
    d.differences()      # where measurement and theory disagree (empty when they agree)

It runs in a fresh subprocess (engines/dryrun.py: a fake process group of `world` ranks and
fake tensors), so the notebook's own process never joins a process group.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queues
import time
import traceback
from dataclasses import dataclass, field

from labkit import theory
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunSpec
from labkit.config.validation import problems
from labkit.results.run import RankReport, RunResult


@dataclass
class DryRun:
    config: ParallelConfig
    model: ModelConfig
    rank: int
    report: RankReport
    """What the meters measured on that rank (losses are NaN: nothing was computed)."""
    predicted_memory: dict = field(repr=False)
    predicted_rows: list[dict] = field(repr=False)
    seconds: float = 0.0

    def comm_table(self) -> list[dict]:
        res = RunResult(self.config, self.model, 1, 0, [float("nan")], [self.report])
        return res.comm_table()

    def differences(self, activation_tolerance: float = 0.10) -> list[str]:
        """Where the measurement disagrees with theory: model states and wire bytes must be equal,
        activations within `activation_tolerance`."""
        out = []
        for k in ("params", "grads", "optimizer"):
            if self.report.memory[k] != self.predicted_memory[k]:
                out.append(f"{k}: measured {self.report.memory[k]:,} B, predicted {self.predicted_memory[k]:,} B")
        a, b = self.report.memory["activations"], self.predicted_memory["activations"]
        if abs(a - b) > activation_tolerance * b:
            out.append(f"activations: measured {a:,} B, predicted {b:,} B")
        key = ("dim", "op", "calls", "payload_bytes", "wire_bytes")
        measured = sorted(tuple(r[k] for k in key) for r in self.comm_table())
        predicted = sorted(tuple(r[k] for k in key) for r in self.predicted_rows)
        if measured != predicted:
            out.append(f"comm rows differ: measured {measured} vs predicted {predicted}")
        return out


def _child(spec: dict, rank: int, world: int, queue) -> None:
    try:
        # imported in the spawned child only: the notebook's process never loads torch for a dry run
        from labkit.engines.dryrun import dry_run_rank

        queue.put(("ok", dry_run_rank(spec, rank, world)))
    except BaseException as e:  # noqa: BLE001 - the parent raises it
        queue.put(("error", "".join(traceback.format_exception(type(e), e, e.__traceback__))))


def dry_run(
    cfg: ParallelConfig,
    model: ModelConfig,
    world: int | None = None,
    rank: int = 0,
    optim: OptimConfig | None = None,
    timeout: float = 600.0,
) -> DryRun:
    """One real training step of rank `rank` in a fake world of `world` ranks (default: the
    layout's product), with fake tensors; compared with theory.estimate for the same layout."""
    world = world or cfg.world
    found = problems(cfg, model, world)
    if model.experts:
        found.append(
            "a dry run cannot route MoE tokens (the all-to-all sizes depend on the data); "
            "use experts=0, or theory.estimate for an MoE layout"
        )
    if not 0 <= rank < world:
        found.append(f"rank={rank} is outside the world of {world} ranks; pick 0 .. {world - 1}")
    if found:
        raise ConfigError(found)
    spec = RunSpec(parallel=cfg, model=model, optim=optim or OptimConfig(), steps=1, seed=0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(spec.to_dict(), rank, world, queue), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                status, payload = queue.get(timeout=0.5)
                break
            except queues.Empty:
                if not proc.is_alive():
                    raise RuntimeError(
                        f"the dry-run process exited with code {proc.exitcode} before "
                        "reporting (a script that calls dry_run needs an "
                        "`if __name__ == '__main__':` guard: it runs in a spawned process)"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the dry run of rank {rank} did not finish within {timeout:g} s") from None
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    if status == "error":
        raise RuntimeError(f"the dry run failed on rank {rank}:\n{payload}")
    payload["clock_offset"] = 0.0
    result = RunResult.from_reports(cfg, model, OptimConfig(), 1, 0, [payload], 0.0)
    est = theory.estimate(cfg, model, world)
    return DryRun(cfg, model, rank, result.ranks[0], est.memory[rank], est.rank_rows(rank), payload["dry_run_seconds"])
