"""A job's structure at the size of the engines at hand: the live run of notebook 14 and tests/test_jobs.py.

What stays: the mesh's dims and their order, the sharding, sequence parallelism, the schedule and
its virtual stages, the shape of uneven stages (a short first or last stage stays short), the
recomputation, the precision, the model's family (GQA, experts, tied head, RoPE scaling, a padded
vocabulary). What shrinks, each said in `Shrunk.shrunk`: every degree above 1 to 2 (model-parallel
dims first: tp, cp, pp, ep, then dp; one that does not fit in the engines goes to 1), the model to
a few tiny blocks, the batch to a few microbatches of one sequence, and what the engines do not run
to its nearest that they do (torchtitan's per-op recompute -> 'selective', impl='torch' -> 'lab'
where PyTorch's building blocks are not wired for the layout, fp8 -> bf16 where the shrunk layout
has no fp8 engine: strategy_problems.py `float8_not_built`).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.choices import ConfigError
from labkit.config.jobs.job import Job
from labkit.config.strategy_problems import float8_not_built
from labkit.config.validation import not_built_yet, problems

KEEP_FIRST = ("tp", "cp", "pp", "ep", "dp")
"""The order degrees are kept in when the engines cannot hold them all: the model-parallel dims
shape what a rank holds and sends; dp only repeats it."""


@dataclass(frozen=True)
class Shrunk:
    parallel: ParallelConfig
    model: ModelConfig
    shrunk: tuple[str, ...]
    """What changed from the job, 'field: job -> here', one per line of a notebook's table."""

    @property
    def world(self) -> int:
        return self.parallel.world


def _degrees(job: Job, engines: int) -> dict[str, int]:
    out, used = {}, 1
    for d in KEEP_FIRST:
        # 2 keeps the dim's groups, collectives and boundaries; more would only repeat them
        keep = getattr(job.parallel, d) > 1 and used * 2 <= engines
        out[d] = 2 if keep else 1
        used *= out[d]
    return out


def _stage_layers(job: Job, pp: int) -> tuple[int, ...]:
    """The job's uneven stage shape on pp * virtual_stages chunks: a short end stays one block
    shorter than the two of the middle (Llama 3.1 405B's 1/2x62/1 -> 1/2x14/1 on 16 chunks)."""
    sl, v = job.parallel.stage_layers, job.parallel.virtual_stages
    if not sl or pp == 1:
        return ()
    mid = sorted(sl)[len(sl) // 2]
    out = [2] * (pp * v)
    out[0] -= sl[0] < mid  # the embedding's stage lighter, as the job's
    out[-1] -= sl[-1] < mid  # the head's
    return tuple(out)


def _model(m: ModelConfig, tp: int, ep: int, layers: int) -> ModelConfig:
    kv = None if m.n_kv_heads == m.heads else 2  # GQA stays GQA: 4 query heads on 2 KV heads
    experts = max(4, 2 * ep) if m.experts else 0
    return m.replace(
        layers=layers, hidden=32, heads=4, kv_heads=kv, ffn=64, seq=32,
        experts=experts, top_k=min(m.top_k, 2) if experts else m.top_k,
        # a padded vocabulary stays padded, at a scale where the padding rows are a few: 250 -> 256 at tp 2
        vocab=250 if m.vocab_divisible_by else 256, vocab_divisible_by=8 if m.vocab_divisible_by else None,
    )  # fmt: skip


def runs(sizes: tuple[int, ...]) -> str:
    """(1, 2, 2, 2, 1) -> '1/2x3/1': a stage split as the planner writes it."""
    out: list[list[int]] = []
    for x in sizes:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return "/".join(f"{x}x{n}" if n > 1 else str(x) for x, n in out) or "even"


def shrink(job: Job, engines: int) -> Shrunk:
    """`job` on `engines` ranks (module docstring); a ConfigError if even that does not run here."""
    p = job.parallel
    deg = _degrees(job, engines)
    sl = _stage_layers(job, deg["pp"])
    layers = sum(sl) if sl else (deg["pp"] * p.virtual_stages if deg["pp"] > 1 else 2)  # a block per chunk
    model = _model(job.model, deg["tp"], deg["ep"], layers)
    # a pipeline needs microbatches >= 2 * pp for the V schedules and a multiple of pp for interleaving
    micro = 2 * deg["pp"] if deg["pp"] > 1 else min(p.microbatches, 2)
    cfg = p.replace(
        **deg, stage_layers=sl, microbatches=micro, global_batch=deg["dp"] * deg["ep"] * micro,
        sequence_parallel=p.sequence_parallel and deg["tp"] > 1,
        checkpoint_activations="selective" if p.recomputation.per_op else p.checkpoint_activations,
        virtual_stages=p.virtual_stages if deg["pp"] > 1 else 1,
        schedule=p.schedule if deg["pp"] > 1 else "1f1b",
    )  # fmt: skip
    # PyTorch's building blocks (FSDP2, DTensor, pipelining) are not wired for every layout: labkit's own
    # implementations run the same arithmetic (its oracle holds both to one process)
    if cfg.torch_impl and not_built_yet(cfg, model):
        cfg = cfg.replace(impl="lab")
    if float8_not_built(cfg, model):  # fp8 that the engines do not run for this layout: its bf16 arithmetic
        cfg = cfg.replace(precision="bf16", fp8_recipe="tensorwise")
    found = problems(cfg, model, engines) + not_built_yet(cfg, model)
    if found:
        raise ConfigError([f"the job shrunk to {engines} engines does not run here: {f}" for f in found])
    # what the user reads next to the run: every field that moved, the job's value first
    said = [f"{d}: {getattr(p, d)} -> {deg[d]}" for d in KEEP_FIRST if getattr(p, d) != deg[d]]
    if p.stage_layers != cfg.stage_layers:
        said.append(f"stage_layers: {runs(p.stage_layers)} -> {runs(cfg.stage_layers)}")
    for name in (
        "schedule",
        "virtual_stages",
        "microbatches",
        "global_batch",
        "sequence_parallel",
        "precision",
        "fp8_recipe",
        "checkpoint_activations",
        "impl",
    ):
        if getattr(p, name) != getattr(cfg, name):
            said.append(f"{name}: {getattr(p, name)!r} -> {getattr(cfg, name)!r}")
    m = job.model
    for name in ("layers", "hidden", "heads", "n_kv_heads", "ffn", "vocab", "seq", "experts", "vocab_divisible_by"):
        if getattr(m, name) != getattr(model, name):
            said.append(f"model {name}: {getattr(m, name)!r} -> {getattr(model, name)!r}")
    return Shrunk(cfg, model, tuple(said))
