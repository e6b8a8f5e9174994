"""The Job a reader makes (labkit/config/jobs/__init__.py), and the GPU count's checks the readers share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.config.choices import ConfigError


@dataclass(frozen=True)
class Job:
    """A training job as its framework's files describe it, in labkit's terms."""

    parallel: ParallelConfig
    """The layout, the global batch, the precision and the recomputation as the file wrote them."""
    model: ModelConfig
    """The architecture; num_params() is the published (unpadded) count, a padded vocabulary apart."""
    source: str
    """The file read (or '<arguments>')."""
    reader: str
    """Which format, and the version of the project the reader follows."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW's numbers where the file gives them (labkit's optimizer is AdamW, constant lr)."""
    notes: tuple[str, ...] = ()
    """Every field of the file labkit does not represent, by name, with what that means for the estimate."""
    gpus_per_node: int | None = None
    """From the launch where it says (torchrun's --nproc-per-node); None: not in the file."""
    stack: str = "eager"
    """The software stack the job runs on (theory/planner/stacks.py): its kernels' pace, which the
    planner prices the job's layout and its alternatives at alike; a caller may override it."""
    stack_reason: str = "the file names no stack: eager PyTorch"
    """Why the reader chose `stack`, quoting the file."""

    @property
    def world(self) -> int:
        return self.parallel.world

    def describe(self) -> str:
        """A few lines: what was read, the layout, the model, and the notes."""
        p, m = self.parallel, self.model
        lines = [
            f"{self.reader}: {self.source}",
            f"  {self.world:,} GPUs: dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} ({p.order}), "
            f"sharding={p.sharding}, sequence_parallel={p.sequence_parallel}, schedule={p.schedule}, "
            f"virtual_stages={p.virtual_stages}, microbatches={p.microbatches}, global_batch={p.global_batch}, "
            f"{p.precision}, recompute={p.recompute}",
            f"  model: {m.arch}, {m.layers} layers, hidden {m.hidden}, {m.heads} heads ({m.n_kv_heads} KV), "
            f"ffn {m.ffn}, vocab {m.vocab:,}, seq {m.seq}; {m.num_params():,} parameters",
            f"  stack: {self.stack} ({self.stack_reason})",
        ]
        if m.vocab_divisible_by:
            lines.append(f"  vocabulary padded to {m.padded_vocab(p.tp):,} rows at tp={p.tp} (vocab_divisible_by)")
        lines += [f"  not represented: {n}" for n in self.notes]
        return "\n".join(lines)


def world_problem(gpus: int | None, world: int | None, where: str) -> list[str]:
    """The GPU count given beside the file against the file's own, quoting both."""
    if gpus is not None and world is not None and gpus != world:
        return [f"gpus={gpus} (given) contradicts {where} = {world} GPUs (the file); give one or make them agree"]
    return []


def need_world(gpus: int | None, world: int | None, what: str) -> int:
    """The GPU count: the file's or the one given; a ConfigError naming what leaves it open otherwise."""
    n = world if world is not None else gpus
    if n is None:
        raise ConfigError([f"{what} leaves the GPU count open; give it (gpus=N, on the command line --gpus N)"])
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError([f"gpus={n!r} must be a positive whole number"])
    return n
