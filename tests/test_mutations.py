"""The oracle cannot be fooled: bugs injected into the real strategies on the real cluster, each of
which `labkit.oracle.checks` must catch, with a message that names the right tensor, rank or step.

A mutation replaces one function or method of a real strategy on every engine for a `with mutated(...)`
block (`lab.apply` ships it by value; the original comes back at the end, whatever happens): nothing in
the code is edited. Each is the original with one bug, written out beside the method it changes. The
layouts run unmutated first and must match (the control): a row is caught by the bug, not the layout.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import pytest
from conftest import TINY
from mutation_bugs import (
    STEPS,
    averaged_twice,
    bucket_never_reduced,
    clipping_skipped_on_rank_1,
    converts_nothing,
    fc1_scaled,
    fsdp2_computes_in_fp32,
    gathered_dkv_kept_home,
    heads_sent_reversed,
    nan_on_rank_2,
    norm_grads_halved,
    norm_over_every_replica,
    padding_in_the_loss,
    projections_never_produced,
    replica_drifts_at_the_end,
    replicas_not_reduced,
    row_parallel_not_reduced,
    run_chunks_swapped,
    sequence_not_gathered,
    shard_off_by_one,
    stale_gather,
    summed_not_averaged,
    tokens_to_the_wrong_rank,
    torch_ddp_summed,
    unmasked_ring_block,
    wrong_microbatch,
)
from mutation_bugs_optim import (
    adam_counts_from_two,
    fc1_routed_to_adamw,
    moments_of_the_next_shard,
    momentum_reset_every_step,
    shard_orthogonalized_alone,
    sharded_clip_skipped,
    slice_kept_whole,
    slice_orthogonalized_alone,
)

from labkit import OptimConfig, ParallelConfig, reference
from labkit.cluster.shipping import register
from labkit.config.validation import muon_problems, not_built_yet, problems
from labkit.layout.buckets import grouped_buckets
from labkit.layout.precision import ELEM
from labkit.oracle.arithmetic import arithmetic, first_shared
from labkit.oracle.checks import margins, mismatches
from labkit.theory.exact.model import param_shapes

PRECISIONS = ("fp32", "bf16", "fp8")
"""Every mutation is planted in each (fp8 where the layout runs fp8): the oracle's bounds differ by precision."""
MOE = TINY.replace(experts=4, top_k=2)
PADDED = TINY.replace(vocab=125, vocab_divisible_by=4)
"""TINY on a vocabulary tp=2 cannot split: 128 rows, the last 3 padding (ModelConfig.vocab_divisible_by)."""
BUCKET_MB = 0.02
"""TINY in several DDP buckets (layout/buckets.py); which tensors bucket 2 holds depends on the precision's bytes."""


def skipped(cfg: ParallelConfig) -> tuple[str, ...]:
    """The tensors of the bucket `bucket_never_reduced` leaves out (bucket 2), as the layout buckets them."""
    named = param_shapes(TINY)
    sizes = [math.prod(shape) * ELEM[cfg.precision] for _, shape in named]
    buckets = grouped_buckets(sizes, [None] * len(sizes), int(BUCKET_MB * 2**20))
    return tuple(named[i][0] for i in buckets[2][1])


# -- the hook: patch one attribute on every engine, and put it back -------------------------------
def _patch(module: str, owner: str | None, attr: str, make: Callable) -> None:
    obj = importlib.import_module(module)
    obj = getattr(obj, owner) if owner else obj
    original = vars(obj)[attr]
    static = isinstance(original, staticmethod)
    new = make(original.__func__ if static else original)
    setattr(obj, f"_lk_original_{attr}", original)
    setattr(obj, attr, staticmethod(new) if static else new)


def _restore(module: str, owner: str | None, attr: str) -> None:
    obj = importlib.import_module(module)
    obj = getattr(obj, owner) if owner else obj
    setattr(obj, attr, vars(obj)[f"_lk_original_{attr}"])
    delattr(obj, f"_lk_original_{attr}")


@contextmanager
def mutated(lab, target: tuple[str, str | None, str], make: Callable):
    """`target` (module, class or None, attribute) replaced by make(original) on every engine."""
    register(make)  # its module by value: the engines cannot import the tests
    lab.apply(lambda: _patch(*target, make))
    try:
        yield
    finally:
        lab.apply(lambda: _restore(*target))


@dataclass(frozen=True)
class Mutation:
    name: str
    cfg: ParallelConfig
    target: tuple[str, str | None, str]
    make: Callable
    check: str
    """The check that must catch it."""
    names: tuple[str, ...] | Callable
    """What that check's messages must name, each in one of them (a tensor, 'rank r', 'step s'); or a
    function of the layout (with its precision) that says."""
    model: object = TINY
    optim: OptimConfig = OptimConfig()
    precisions: tuple[str, ...] = PRECISIONS
    """The precisions it is planted in, each where labkit builds the layout (`runs`)."""
    also: tuple = ()
    """A second (target, make) planted with the first, where one bug changes two places."""

    def runs(self) -> list[ParallelConfig]:
        """The layout in each of its precisions that labkit builds on the session's 4 engines."""
        out = []
        for p in self.precisions:
            cfg = self.cfg.replace(precision=p)
            if not (
                problems(cfg, self.model, 4)
                or not_built_yet(cfg, self.model)
                or muon_problems(cfg, self.model, self.optim)
            ):
                out.append(cfg)
        return out


E = "labkit.engines.parallel."
DDP4 = ParallelConfig(dp=4, bucket_mb=BUCKET_MB)
FSDP2 = ParallelConfig(dp=4, sharding="fsdp", impl="torch")
MUON = OptimConfig(name="muon")
MUTATIONS = [
    Mutation("a DDP bucket never reduced", DDP4, (E + "ddp", "DDP", "_launch_ready"), bucket_never_reduced,
             "gradients", skipped),
    Mutation("gradients summed, not averaged", DDP4, (E + "ddp", "DDP", "finish"), summed_not_averaged,
             "gradients", ("every tensor's step 0 reduced gradient is 4 times",)),
    Mutation("TP's row-parallel all-reduce skipped", ParallelConfig(tp=2, dp=2),
             (E + "tensor", "RowParallelLinear", "forward"), row_parallel_not_reduced, "losses", ("step 0",)),
    Mutation("SP's all-gather skipped", ParallelConfig(tp=2, dp=2, sequence_parallel=True),
             (E + "tensor", "Gather", "forward"), sequence_not_gathered, "losses", ("step 0",)),
    Mutation("a ZeRO shard off by one element", ParallelConfig(dp=4, sharding="zero1"),
             (E + "zero", "ZeRO12", "finish"), shard_off_by_one, "gradients", ("embed.tok.weight",)),
    Mutation("ZeRO-3 using stale gathered parameters", ParallelConfig(dp=4, sharding="zero3"),
             (E + "zero3", "ZeRO3", "_free"), stale_gather, "losses", ("step 1",)),
    Mutation("a replica diverging only in the last step", DDP4, (E + "ddp", "DDP", "step"),
             replica_drifts_at_the_end, "replicas", ("blocks.0.attn.wq.weight", "rank 3")),
    Mutation("a pipeline stage receiving the wrong microbatch", ParallelConfig(pp=2, dp=2, microbatches=2),
             (E + "pipeline", "PipelineExecutor", "_tag"), wrong_microbatch, "losses", ("step 0",)),
    Mutation("ring attention without the causal mask on one rank's blocks", ParallelConfig(cp=2, dp=2),
             (E + "context", None, "_scores"), unmasked_ring_block, "losses", ("step 0",)),
    Mutation("all-gather CP's dK/dV not reduce-scattered", ParallelConfig(cp=2, dp=2, cp_kind="allgather"),
             (E + "context.kinds", None, "reduce_scatter_single"), gathered_dkv_kept_home, "gradients",
             ("blocks.1.attn.wv.weight", "blocks.0.attn.wv.weight")),
    Mutation("Ulysses' all-to-all splitting the heads wrongly", ParallelConfig(cp=2, dp=2, cp_kind="ulysses"),
             (E + "context.kinds", None, "_to_heads"), heads_sent_reversed, "losses", ("step 0",)),
    Mutation("hierarchical CP's ring reading a run's chunks in the wrong order",
             ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2), (E + "context.kinds", None, "zigzag_chunks"),
             run_chunks_swapped, "losses", ("step 0",)),
    Mutation("HSDP's replicate all-reduce skipped", ParallelConfig(dp=4, dp_replicate=2, sharding="fsdp"),
             (E + "zero3", None, "all_reduce_replicas"), replicas_not_reduced, "gradients", ("embed.tok.weight",)),
    Mutation("HSDP's norm counted once per replica", ParallelConfig(dp=4, dp_replicate=2, sharding="zero2"),
             (E + "shards", None, "norm_terms"), norm_over_every_replica, "grad norms", ("step 0",)),
    Mutation("an expert's tokens returned to the wrong rank", ParallelConfig(ep=2, dp=2),
             (E + "experts", "ExpertParallel", "__call__"), tokens_to_the_wrong_rank, "losses", ("step 0",), MOE),
    Mutation("gradient clipping skipped on one rank", DDP4, (E + "ddp", "DDP", "step"), clipping_skipped_on_rank_1,
             "replicas", ("rank 1",), optim=OptimConfig(clip=0.5)),
    Mutation("a NaN appearing on one rank", DDP4, (E + "ddp", "DDP", "finish"), nan_on_rank_2, "finite",
             ("rank 2", "step(s) [1]")),
    Mutation("a padded vocabulary's padding logits left in the loss", ParallelConfig(tp=2, dp=2),
             ("labkit.engines.loss", "MaskPadding", "forward"), padding_in_the_loss, "padding",
             ("head.proj.weight", "[125:)"), PADDED),
    Mutation("every norm's gradient halved", DDP4, (E + "ddp", "DDP", "finish"), norm_grads_halved, "gradients",
             ("head.norm.weight: step 0",)),
    Mutation("attention's wq and wk gradients never produced", DDP4, (E + "ddp", "DDP", "finish"),
             projections_never_produced, "gradients", ("blocks.0.attn.wq.weight", "blocks.1.attn.wk.weight")),
    Mutation("the MLP's fc1 gradients 0.8 of themselves", DDP4, (E + "ddp", "DDP", "finish"), fc1_scaled,
             "gradients", ("blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc1.weight")),
    Mutation("every gradient averaged twice (halved)", DDP4, (E + "ddp", "DDP", "finish"), averaged_twice,
             "gradients", ("every tensor's step 0 reduced gradient is 0.5 times",)),
    Mutation("fp8 layers never converted (the run computes in bf16)", DDP4,
             ("labkit.engines.parallelize", None, "convert"), converts_nothing, "float8", ("rank 0", "none ran in fp8"),
             precisions=("fp8",)),
    Mutation("a ZeRO-1 shard stepping with the next shard's Adam moments", ParallelConfig(dp=4, sharding="zero1"),
             (E + "zero", "ZeRO12", "step"), moments_of_the_next_shard, "parameters", ("the final parameters",)),
    Mutation("Adam's step counter one ahead", ParallelConfig(dp=4, sharding="zero2"),
             ("labkit.engines.optim", "AdamW", "step"), adam_counts_from_two, "parameters", ("the final parameters",)),
    Mutation("gradient clipping skipped on a sharded layout, where it binds", ParallelConfig(dp=4, sharding="zero2"),
             (E + "shards", "ShardedOptimizer", "step"), sharded_clip_skipped, "parameters", ("the final parameters",),
             optim=OptimConfig(clip=0.5)),
    Mutation("PyTorch's DDP summing the ranks' gradients, not averaging", ParallelConfig(dp=4, impl="torch"),
             (E + "ddp", "TorchDDP", "__init__"), torch_ddp_summed, "gradients", ("reduced gradient is 4 times",)),
    Mutation("Muon orthogonalizing each tp rank's slice alone, not the whole matrix", ParallelConfig(tp=2, dp=2),
             ("labkit.engines.muon", "Whole", "gather"), slice_orthogonalized_alone, "parameters",
             ("the final parameters",), optim=MUON, also=(("labkit.engines.muon", "Whole", "mine"), slice_kept_whole)),
    Mutation("Distributed Muon orthogonalizing each ZeRO slice alone, not the gathered matrix",
             ParallelConfig(dp=4, sharding="zero1"), ("labkit.engines.muon", "ShardedMuon", "gather"),
             shard_orthogonalized_alone, "parameters", ("the final parameters",), optim=MUON),
    Mutation("Muon's momentum reset every step", DDP4, ("labkit.engines.muon", "Muon", "step"),
             momentum_reset_every_step, "parameters", ("the final parameters",), optim=MUON),
    Mutation("the MLP's fc1 routed to AdamW, not Muon", DDP4, ("labkit.engines.muon", None, "takes_muon"),
             fc1_routed_to_adamw, "parameters", ("blocks.0.mlp.fc1.weight",), optim=MUON),
    Mutation("PyTorch's FSDP2 computing in fp32 while it says bf16", FSDP2, (E + "fsdp", "TorchFSDP", "__init__"),
             fsdp2_computes_in_fp32, "gradients", ("step 0's reduced gradient",), precisions=("bf16",)),
]  # fmt: skip
"""OptimConfig(clip=0.5) where clipping must act: TINY's gradient norms are 0.82 to 0.92, under the
default max norm of 1.0."""


@pytest.fixture(scope="module")
def oracle():
    cache = {}

    def get(model, optim):
        if (model, optim) not in cache:
            cache[model, optim] = reference(model, steps=STEPS, optim=optim)
        return cache[model, optim]

    return get


def test_every_mutation_is_caught_and_named(lab, oracle):
    """Each bug in each precision its layout runs (fp32, bf16, fp8): caught, by the check that must catch
    it, naming what it must. The margin printed is the worst bounded check's error over its bound; the
    arithmetic is the reference's (labkit/oracle/arithmetic.py: 'shared' where it computes the run's every
    rounding but its reduction's; else the counted chain's bound, and the fp32 row is the same layout's
    twin, which holds its logic at 1e-5)."""
    rows, honest = [], {}
    for m in MUTATIONS:
        ref = oracle(m.model, m.optim)
        for cfg in m.runs():
            key = (cfg, m.model, m.optim)
            if key not in honest:  # the control: the same layout, unmutated, matches
                res = lab.run(cfg, model=m.model, steps=STEPS, optim=m.optim, return_params=True)
                honest[key] = mismatches(res, ref)
            with mutated(lab, m.target, m.make), mutated(lab, *m.also) if m.also else nullcontext():
                res = lab.run(cfg, model=m.model, steps=STEPS, optim=m.optim, return_params=True)
            found = mismatches(res, ref)
            kind = "shared" if arithmetic(res).shared else "counted" if cfg.precision != "fp32" else "1e-5"
            kind = "1st shared" if first_shared(res) is not None else kind  # FSDP2: its first step one process's
            expected = [f.message for f in found if f.check == m.check]
            names = m.names(cfg) if callable(m.names) else m.names
            named = expected if all(any(w in x for x in expected) for w in names) else []
            if kind == "counted":  # the chain's bound catches what it can; its fp32 twin's row must name it
                named = [str(f) for f in found]
            rows.append((m, cfg.precision, kind, found, named, margins(res, ref)))
    print(f"\n{'mutation':<64} {'prec':<5} {'bound':<10} {'caught':<7} {'margin':>9}  by (then the first messages)")
    for m, precision, kind, found, named, over in rows:
        checks = list(dict.fromkeys(f.check for f in found))
        # how far past its bound the worst bounded check sits (replicas, finite, padding, routing: exact checks)
        worst = max((v for k, v in over.items() if k != "flips"), default=float("nan"))
        print(
            f"{m.name:<64} {precision:<5} {kind:<10} {'yes' if named else 'NO':<7} {worst:>9.3g}  "
            f"{', '.join(checks) or '-'}"
        )
        for x in (named or [f"{f}" for f in found])[: 3 if named else 12]:
            print(f"{'':<6}{x[:160]}")
    assert {k: v for k, v in honest.items() if v} == {}, "an unmutated layout does not match"
    missed = [f"{m.name} ({precision})" for m, precision, _, _, named, _ in rows if not named]
    assert missed == [], "mutations not caught (or not named)"
    # a layout whose arithmetic no reference shares is held at fp32 too (labkit/oracle/arithmetic.py twin)
    twins = {m.name for m, precision, kind, *_ in rows if kind == "counted"}
    assert twins <= {m.name for m, precision, *_ in rows if precision == "fp32"}, "a counted row without its twin"
    assert {p for _, p, *_ in rows} == set(PRECISIONS), "a precision no mutation ran in"
