"""Where a run first leaves the one-process reference (labkit/oracle/locate.py): bugs planted on the real
cluster's engines (tests/mutation_bugs.py, planted as tests/test_mutations.py plants them) are located at
the module, direction, ranks and rows they corrupt first, or at the phase outside every module; correct
layouts locate nothing; what is not yet located is refused at the door by name."""

from __future__ import annotations

import re
import time
from contextlib import nullcontext

import pytest
from conftest import TINY
from mutation_bugs import (
    STEPS,
    bucket_never_reduced,
    copy_grad_not_reduced,
    gathered_dkv_kept_home,
    heads_sent_reversed,
    padding_in_the_loss,
    row_parallel_not_reduced,
    run_chunks_swapped,
    sequence_not_gathered,
    summed_not_averaged,
    tokens_to_the_wrong_rank,
    unmasked_ring_block,
    wrong_microbatch,
)
from test_mutations import DDP4, MOE, PADDED, mutated, skipped

from labkit import ConfigError, OptimConfig, ParallelConfig, reference
from labkit.oracle.checks import mismatches
from labkit.oracle.locate import locate, locate_bytes, margin, ratios, reference_records
from labkit.widgets.figures import locate_figure

E = "labkit.engines.parallel."
TP_SP = ParallelConfig(tp=2, dp=2, sequence_parallel=True)


@pytest.fixture(scope="module")
def refs():
    cache = {}

    def get(model, optim=None):
        if (model, optim) not in cache:
            ref = reference(model, steps=STEPS, optim=optim)
            cache[model, optim] = ref, reference_records(_Stub(model), ref)
        return cache[model, optim]

    return get


class _Stub:
    """What reference_records reads of a run where the reference says nothing (its seed and batch)."""

    def __init__(self, model):
        self.model, self.seed, self.config = model, 0, ParallelConfig()


def run_located(lab, refs, cfg, model=TINY, optim=None):
    ref, own = refs(model, optim)
    res = lab.run(cfg, model=model, steps=STEPS, optim=optim, return_params=True, locate=True)
    # bf16: the reference in the run's arithmetic (its threads, its batch split), read off the run
    where = locate(res, ref, own if cfg.precision == "fp32" else None)
    print(f"\nlocated: {where}")
    return res, where


CORRECT = {
    "ddp": DDP4,
    "torch-ddp": ParallelConfig(dp=4, impl="torch"),
    "fsdp2": ParallelConfig(dp=4, sharding="fsdp", impl="torch"),
    "hsdp": ParallelConfig(dp=4, dp_replicate=2, sharding="fsdp"),
    "zero3-microbatches": ParallelConfig(dp=2, sharding="zero3", microbatches=2),
    "tp-sp": TP_SP,
    "tp-checkpointed": ParallelConfig(tp=2, dp=2, checkpoint_activations=True),
    "pp-dp": ParallelConfig(pp=2, dp=2, microbatches=2),
    "pp-tp-sp": ParallelConfig(pp=2, tp=2, microbatches=2, sequence_parallel=True),
    "zero-bubble": ParallelConfig(pp=2, dp=2, microbatches=2, schedule="zbh1"),
    "gpipe-zero2": ParallelConfig(pp=2, dp=2, microbatches=2, schedule="gpipe", sharding="zero2"),
    "interleaved": ParallelConfig(pp=2, dp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
    "cp-ring": ParallelConfig(cp=2, dp=2),
    "cp-tp-sp": ParallelConfig(cp=2, tp=2, sequence_parallel=True),
    "cp-ulysses": ParallelConfig(cp=2, dp=2, cp_kind="ulysses"),
    "cp-hierarchical": ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2),
}
"""Layouts that must locate nothing: every dim, PyTorch's DDP and FSDP2, HSDP, four schedules, CP's kinds."""


@pytest.mark.parametrize("cfg", CORRECT.values(), ids=CORRECT.keys())
def test_a_correct_run_locates_nothing(lab, refs, cfg):
    """Every rank's piece of every module's output and gradient, put back by the layout (rows over dp and
    microbatches, tp's columns or SP's sequence, pp's stages), within fp32's bound of one process; and every
    element of the reference's tensors in some rank's piece (else locate names the hole)."""
    model = TINY.replace(layers=4) if cfg.virtual_stages > 1 else TINY  # a chunk per virtual stage's block
    ref, own = refs(model)
    res, where = run_located(lab, refs, cfg, model)
    print(f"the worst piece's error over its bound: {margin(res, own):.3g}")
    assert where is None
    assert mismatches(res, ref) == []
    held = [rk["bytes"] for rk in res.activations]
    assert max(held) <= locate_bytes(cfg, model)
    if cfg.tp == 1 and cfg.pp == 1:  # the estimate is exact where every rank holds every module whole
        assert held == [locate_bytes(cfg, model)] * cfg.world


FAMILIES = {
    "llama-tp4": (TINY.replace(arch="llama", kv_heads=2), ParallelConfig(tp=4)),  # KV heads shared: not compared
    "gpt2-pp-tp": (TINY.replace(arch="gpt2"), ParallelConfig(pp=2, tp=2, microbatches=2)),  # tied, biases
    "gemma3-tp-sp": (TINY.replace(arch="gemma3", kv_heads=2), TP_SP),  # four norms a block, windows, GeGLU
}


@pytest.mark.parametrize("model, cfg", FAMILIES.values(), ids=FAMILIES.keys())
def test_the_other_families_locate_nothing_when_correct(lab, refs, model, cfg):
    """SwiGLU's gate/up/down, GQA, biases, a tied head across stages, Gemma's post-norms: placed as TINY's."""
    assert run_located(lab, refs, cfg, model)[1] is None


def test_a_piece_no_rank_recorded_is_located_as_a_hole(lab, refs):
    """The reassembly covers every element of the reference's records: rank 3's records dropped from a
    correct DDP run leave the global batch's last two rows in no piece, named at the first record."""
    ref, own = refs(TINY)
    res = lab.run(DDP4, model=TINY, steps=STEPS, locate=True)
    assert locate(res, ref, own) is None
    res.activations = [rk for rk in res.activations if rk["rank"] != 3]
    p = locate(res, ref, own).point
    assert (p.module, p.direction) == ("embed", "forward")
    assert p.where == "batch rows 6-7, sequence rows 0-15, columns 0-31 computed on no rank"


def test_a_row_parallel_output_not_reduced_is_located_at_attention_s_wo(lab, refs):
    """The all-reduce after attention's wo skipped: wo's output is each tp rank's partial sum, every row."""
    with mutated(lab, (E + "tensor", "RowParallelLinear", "forward"), row_parallel_not_reduced):
        res, where = run_located(lab, refs, ParallelConfig(tp=2, dp=2))
    p = where.point
    assert (p.module, p.direction) == ("blocks.0.attn.wo", "forward")
    assert str(res.located(refs(TINY)[0])) == str(where)  # the result's own verdict, its reference computed
    assert p.where == "tp ranks 0-1, dp ranks 0-1" and p.error > 1e3 * p.bound
    assert str(where).startswith("block 0, attn.wo forward output, tp ranks 0-1, dp ranks 0-1: ")
    assert str(where).endswith("over a bound of 1e-05; its inputs matched")


def test_a_sequence_not_gathered_is_located_at_the_rows_each_tp_rank_lacks(lab, refs):
    """SP's all-gather skipped: each tp rank repeats its own s/2 rows, so the gathered input wq reads (ln1's
    output, which matched, through the all-gather) is wrong on tp rank 0 in the second half of the sequence
    and on tp rank 1 in the first."""
    with mutated(lab, (E + "tensor", "Gather", "forward"), sequence_not_gathered):
        _, where = run_located(lab, refs, TP_SP)
    p = where.point
    assert (p.module, p.direction) == ("blocks.0.attn.wq.input", "forward")
    half = TINY.seq // 2
    first, second = f"0-{half - 1}", f"{half}-{TINY.seq - 1}"
    assert p.where == f"tp rank 0, dp ranks 0-1, sequence rows {second}; tp rank 1, dp ranks 0-1, sequence rows {first}"
    assert str(where).startswith("block 0, attn.wq forward input, tp rank 0")
    assert str(where).endswith("; what it was made from matched")


@pytest.mark.parametrize("bug", [bucket_never_reduced, summed_not_averaged], ids=["bucket", "summed"])
def test_a_data_parallel_bug_is_located_at_the_reduction(lab, refs, bug):
    """Outside every module: each rank's forward and backward are one process's on its rows, so every record
    matches, and the phase is the gradients' reduction, with the oracle's words for what it got wrong."""
    target = "_launch_ready" if bug is bucket_never_reduced else "finish"
    with mutated(lab, (E + "ddp", "DDP", target), bug):
        _, where = run_located(lab, refs, DDP4)
    assert where.point is None and where.phase == "the gradients' reduction"
    if bug is bucket_never_reduced:
        assert any(name in where.mismatch for name in skipped(DDP4))
    else:
        assert "4 times the reference's" in where.mismatch
    assert str(where).startswith("the gradients' reduction, after every module's forward and backward matched")


def test_f_s_backward_not_reduced_is_located_in_backward_at_the_first_replicated_input(lab, refs):
    """Copy's backward all-reduce skipped: every forward matches; in backward the first gradient into a
    replicated input is the head's (head.norm's output, read by each tp rank's vocabulary slice)."""
    with mutated(lab, (E + "tensor.ops", "Copy", "backward"), copy_grad_not_reduced):
        _, where = run_located(lab, refs, ParallelConfig(tp=2, dp=2))
    p = where.point
    assert (p.module, p.direction, p.where) == ("head.norm", "backward", "tp ranks 0-1, dp ranks 0-1")
    assert str(where).startswith("head.norm backward, the gradient into its output, tp ranks 0-1, dp ranks 0-1: ")


def test_a_stage_fed_the_wrong_microbatch_is_located_at_its_first_module_on_its_pp_rank(lab, refs):
    """The second stage receives the other microbatch's activations: its first module (block 1's ln1) is
    wrong on pp rank 1 for both microbatches, every row; stage 0's every record matched."""
    with mutated(lab, (E + "pipeline", "PipelineExecutor", "_tag"), wrong_microbatch):
        _, where = run_located(lab, refs, ParallelConfig(pp=2, dp=2, microbatches=2))
    p = where.point
    assert (p.module, p.direction, p.where) == ("blocks.1.ln1", "forward", "dp ranks 0-1, pp rank 1, microbatches 0-1")


def test_context_parallel_bugs_are_located_at_the_zigzag_rows_of_their_cp_rank(lab, refs):
    """CP's records put back by the zigzag (cp rank r holds chunks r and 2cp-1-r of 2cp): ring attention's
    diagonal blocks unmasked on global rank 0 (cp rank 0 of dp rank 0) make attention's core, wo's input,
    wrong at its chunks' rows but each chunk's last (which sees its whole chunk anyway); the all-gather
    kind's dK/dV kept home is located in backward at block 1's wv; Ulysses' heads sent reversed, at block 0's
    wo's input on every rank; the hierarchical ring reading its runs' chunks swapped, at the same place."""
    c = TINY.seq // 4  # a chunk's rows at cp=2
    cases = [
        (ParallelConfig(cp=2, dp=2), "_scores", unmasked_ring_block),
        (ParallelConfig(cp=2, dp=2, cp_kind="allgather"), "reduce_scatter_single", gathered_dkv_kept_home),
        (ParallelConfig(cp=2, dp=2, cp_kind="ulysses"), "_to_heads", heads_sent_reversed),
        (ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2), "zigzag_chunks", run_chunks_swapped),
    ]
    found = []
    for cfg, attr, bug in cases:
        module = "context" if bug is unmasked_ring_block else "context.kinds"
        with mutated(lab, (E + module, None, attr), bug):
            found.append(run_located(lab, refs, cfg)[1].point)
    ring, dkv, heads, runs = found
    assert (ring.module, ring.direction) == ("blocks.0.attn.wo.input", "forward")
    assert ring.where == f"cp rank 0, dp rank 0, sequence rows 0-{c - 2}, {3 * c}-{4 * c - 2}"
    assert (dkv.module, dkv.direction) == ("blocks.1.attn.wv", "backward")
    assert (heads.module, heads.direction, heads.where) == (
        "blocks.0.attn.wo.input",
        "forward",
        "cp ranks 0-1, dp ranks 0-1",
    )
    assert (runs.module, runs.direction) == ("blocks.0.attn.wo.input", "forward")


def test_experts_under_ep_and_tp_locate_nothing_and_a_token_sent_home_wrong_is_located(lab, refs):
    """The MoE model (4 experts, top 2): under ep x dp and tp + SP (the layer replicated over tp, SP's rows
    gathered in and split out) nothing is located; experts' results sent home swapped (the combine swaps two
    routed slots on every rank) are located at block 0's MoE output, on every (ep, dp) rank, at the two
    tokens each swap reached and no others."""
    for cfg in (ParallelConfig(ep=2, dp=2), ParallelConfig(tp=2, dp=2, sequence_parallel=True)):
        assert run_located(lab, refs, cfg, MOE)[1] is None
    with mutated(lab, (E + "experts", "ExpertParallel", "__call__"), tokens_to_the_wrong_rank):
        _, where = run_located(lab, refs, ParallelConfig(ep=2, dp=2), MOE)
    p = where.point
    assert (p.module, p.direction) == ("blocks.0.mlp", "forward")
    parts = p.where.split("; ")
    assert len(parts) == 4 and all(re.search(r"dp rank \d, batch rows \d, sequence rows \d+, \d+$", x) for x in parts)


def test_padding_logits_left_in_the_loss_are_located_at_the_head_columns_on_their_tp_rank(lab, refs):
    """tp=2 on vocab 125 padded to 128: tp rank 1 holds columns 64-127, of which 125-127 are padding. With
    the mask skipped they are 0, not -inf, where the loss reads them: the logits' forward, those columns,
    that rank (tp rank 0's columns are all tokens and match)."""
    with mutated(lab, ("labkit.engines.loss", "MaskPadding", "forward"), padding_in_the_loss):
        res, where = run_located(lab, refs, ParallelConfig(tp=2, dp=2), PADDED)
    p = where.point
    assert (p.module, p.direction) == ("head.proj", "forward")
    assert p.where == "tp rank 1, dp ranks 0-1, columns 125-127"
    assert "not the mask's -inf" in p.note
    assert str(where).startswith("head.proj (the logits) forward output, tp rank 1, dp ranks 0-1, columns 125-127")
    # drawn: every record before it green (under the bound), the logits' forward at the ceiling, marked first
    rows = ratios(res, refs(PADDED)[1])
    fig = locate_figure(rows)
    heat = fig.data[0]
    z = dict(zip(heat.y, heat.z))
    assert z["head.proj"][0] == 4.0 and all(z[m][0] < 0 for m in heat.y[: list(heat.y).index("head.proj")])
    assert (fig.layout.annotations[0].y, fig.layout.annotations[0].x) == ("head.proj", "forward")


def test_the_same_layout_unmutated_with_padding_locates_nothing(lab, refs):
    """The control of the padding row: the mask's -inf is what a correct run holds there."""
    _, where = run_located(lab, refs, ParallelConfig(tp=2, dp=2), PADDED)
    assert where is None


@pytest.mark.parametrize(
    "cfg, model, words",
    [
        (ParallelConfig(tp=2, dp=2, precision="bf16"), TINY, "in bf16 under a layout whose arithmetic is not"),
        (ParallelConfig(dp=4, precision="fp8"), TINY, "locate=True in fp8"),
        (ParallelConfig(pp=2, dp=2, microbatches=2, impl="torch"), TINY, "torch.distributed.pipelining"),
        (DDP4, TINY.replace(layers=64, hidden=512, heads=8, ffn=2048, seq=256), "MiB per rank"),
    ],
    ids=["bf16-tp", "fp8", "torch-pp", "too-large"],
)
def test_what_is_not_yet_located_is_refused_by_name(lab, cfg, model, words):
    """At the door, before any engine work: bf16 where the arithmetic is not one process's, fp8, PyTorch's
    pipelining (its own forwards), and a model whose records would pass 256 MiB a rank; each names the fix."""
    with pytest.raises(ConfigError, match="locate=True") as err:
        lab.run(cfg, model=model, steps=1, locate=True)
    assert words in str(err.value)


def test_locate_is_a_bool_and_off_by_default(lab):
    with pytest.raises(ConfigError, match="locate=1 must be True or False"):
        lab.run(DDP4, model=TINY, steps=1, locate=1)
    assert lab.run(DDP4, model=TINY, steps=1).activations is None


BF16 = {"ddp": DDP4.replace(precision="bf16"), "pp": ParallelConfig(pp=2, dp=2, microbatches=2, precision="bf16")}


def test_bf16_layouts_that_split_only_the_batch_are_held_to_one_rounding(lab, refs):
    """bf16 where one process computes the run's every rounding but its reduction's (labkit/oracle/
    arithmetic.py): the reference split as the layout splits its batch, each record the run's to the bit
    (margin 0), held at one bf16 rounding. The controls unmutated locate nothing; the bugs are located as
    in fp32: the wrong microbatch at block 1's ln1 on pp rank 1, a bucket never reduced at the reduction."""
    for cfg in BF16.values():
        res, where = run_located(lab, refs, cfg)
        assert where is None
        assert margin(res, reference_records(res, refs(TINY)[0])) == 0.0
    with mutated(lab, (E + "pipeline", "PipelineExecutor", "_tag"), wrong_microbatch):
        _, where = run_located(lab, refs, BF16["pp"])
    assert (where.point.module, where.point.where) == ("blocks.1.ln1", "dp ranks 0-1, pp rank 1, microbatches 0-1")
    assert f"over a bound of {2**-8:.2g}" in str(where)
    with mutated(lab, (E + "ddp", "DDP", "_launch_ready"), bucket_never_reduced):
        _, where = run_located(lab, refs, BF16["ddp"])
    assert where.point is None and where.phase == "the gradients' reduction"


def test_the_cost_of_locating(lab, refs):
    """What locate=True costs on TINY under dp=4: the bytes each rank ships (its records) and the wall time
    against the same run without it (printed for the note; asserted only to be finite and bounded)."""
    walls = {}
    for flag in (False, True, False, True):
        t0 = time.perf_counter()
        res = lab.run(DDP4, model=TINY, steps=STEPS, locate=flag)
        walls.setdefault(flag, []).append(time.perf_counter() - t0)
    ref, own = refs(TINY)
    t0 = time.perf_counter()
    assert locate(res, ref, own) is None
    oracle = time.perf_counter() - t0
    per_rank = res.activations[0]["bytes"]
    print(
        f"\nlocate on TINY, dp=4, {STEPS} steps: {per_rank} bytes per rank; run {min(walls[False]):.2f} s, "
        f"with locate {min(walls[True]):.2f} s; the oracle's comparison {oracle:.3f} s"
    )
    assert per_rank == locate_bytes(DDP4, TINY)


REDUCTION, UPDATE = "the gradients' reduction", "the update"
WHERE = {
    "a DDP bucket never reduced": REDUCTION,
    "gradients summed, not averaged": REDUCTION,
    "TP's row-parallel all-reduce skipped": ("blocks.0.attn.wo", "forward"),
    "SP's all-gather skipped": ("blocks.0.attn.wq.input", "forward"),
    "a ZeRO shard off by one element": REDUCTION,
    "ZeRO-3 using stale gathered parameters": UPDATE,
    "a replica diverging only in the last step": UPDATE,
    "a pipeline stage receiving the wrong microbatch": ("blocks.1.ln1", "forward"),
    "ring attention without the causal mask on one rank's blocks": ("blocks.0.attn.wo.input", "forward"),
    "all-gather CP's dK/dV not reduce-scattered": ("blocks.1.attn.wv", "backward"),
    "Ulysses' all-to-all splitting the heads wrongly": ("blocks.0.attn.wo.input", "forward"),
    "hierarchical CP's ring reading a run's chunks in the wrong order": ("blocks.0.attn.wo.input", "forward"),
    "HSDP's replicate all-reduce skipped": REDUCTION,
    "HSDP's norm counted once per replica": "the clip (the gradient norm)",
    "an expert's tokens returned to the wrong rank": ("blocks.0.mlp", "forward"),
    "gradient clipping skipped on one rank": UPDATE,
    "a NaN appearing on one rank": "step 1 (locate records step 0 alone)",
    "a padded vocabulary's padding logits left in the loss": ("head.proj", "forward"),
    "every norm's gradient halved": REDUCTION,
    "attention's wq and wk gradients never produced": REDUCTION,
    "the MLP's fc1 gradients 0.8 of themselves": REDUCTION,
    "every gradient averaged twice (halved)": REDUCTION,
    "a ZeRO-1 shard stepping with the next shard's Adam moments": UPDATE,
    "Adam's step counter one ahead": UPDATE,
    "gradient clipping skipped on a sharded layout, where it binds": UPDATE,
    "PyTorch's DDP summing the ranks' gradients, not averaging": REDUCTION,
    "Muon orthogonalizing each tp rank's slice alone, not the whole matrix": UPDATE,
    "Distributed Muon orthogonalizing each ZeRO slice alone, not the gathered matrix": UPDATE,
    "Muon's momentum reset every step": UPDATE,
    "the MLP's fc1 routed to AdamW, not Muon": UPDATE,
}
"""Where each fp32 mutation of tests/test_mutations.py is located: the module and direction it first
corrupts, or the phase outside every module (the two fp8 / bf16-only rows are refused at the door)."""


def test_every_mutation_of_the_oracle_s_suite_is_located_where_it_acts(lab, refs):
    """Each mutation tests/test_mutations.py plants, in fp32 where its layout runs: located at the module
    it changes or first corrupts, or at its phase; each row named (a new mutation needs its row here)."""
    from test_mutations import MUTATIONS

    rows, wrong = [], []
    for m in MUTATIONS:
        cfg = next((c for c in m.runs() if c.precision == "fp32"), None)
        if cfg is None:
            continue
        with mutated(lab, m.target, m.make), mutated(lab, *m.also) if m.also else nullcontext():
            _, where = run_located(lab, refs, cfg, m.model, m.optim if m.optim != OptimConfig() else None)
        got = None if where is None else where.phase or (where.point.module, where.point.direction)
        rows.append((m.name, got, str(where)))
        if got != WHERE.get(m.name, "a row of WHERE"):
            wrong.append(f"{m.name}: {got}")
    for name, _, sentence in rows:
        print(f"{name:<70} {sentence[:150]}")
    assert len(rows) == len(WHERE) and wrong == []
