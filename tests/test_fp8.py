"""FP8 training on the 4-engine gloo cluster: the blocks' linear layers in fp8 as torchtitan
converts them with torchao 0.18, under DDP, FSDP (ours and FSDP2, both gathering weights in fp8),
TP + SP (ours), FSDP2 with torchao's float8 TP styles, and a pipeline (with FSDP too); each trains
like the one-process fp8 reference (torchao's own Float8Linear, split as the layout splits its batch)
within the derived bounds (shared arithmetic: labkit/oracle/arithmetic.py; else labkit/oracle/bounds_fp8.py),
every rank ran the fp8 matmuls its layout converts (labkit/oracle/float8.py), and every byte each rank holds and sends
equals the theory (labkit/theory/exact/float8.py). A scale bug is caught; what is not built is refused.

torch 2.13's CPU `torch._scaled_mm` multiplies float8_e4m3fn / e5m2 operands with per-tensor scales
into bf16, so the operands, the gathered weights and the saved fp8 inputs are one-byte tensors.
"""

from __future__ import annotations

import copy
from math import prod

import numpy as np
import pytest
import torch
from conftest import TINY
from families import LLAMA
from test_mutations import mutated
from test_sharding import check_against_theory
from theory_match import compare

from labkit import ConfigError, ModelConfig, ParallelConfig, reference, theory, validate
from labkit.cluster.shipping import register
from labkit.engines import data
from labkit.engines.float8 import convert, convert_torchao
from labkit.engines.model import build_model
from labkit.layout.float8 import float8_weights, round_e4m3
from labkit.oracle.arithmetic import arithmetic
from labkit.oracle.checks import assert_matches, margins, mismatches

STEPS = 3
LAYOUTS = {
    "ddp": (ParallelConfig(dp=4, precision="fp8"), TINY),
    "fsdp": (ParallelConfig(dp=4, sharding="fsdp", precision="fp8"), TINY),
    "fsdp2": (ParallelConfig(dp=4, sharding="fsdp", impl="torch", precision="fp8"), TINY),
    "fsdp2_tp": (ParallelConfig(tp=2, dp=2, sharding="fsdp", impl="torch", precision="fp8"), TINY),
    "tp_sp": (ParallelConfig(tp=2, dp=2, sequence_parallel=True, precision="fp8"), TINY),
    "tp_sp_llama": (ParallelConfig(tp=2, dp=2, sequence_parallel=True, precision="fp8"), LLAMA),
    "pp_1f1b": (ParallelConfig(pp=2, dp=2, microbatches=2, precision="fp8"), TINY),
    "pp_1f1b_fsdp": (ParallelConfig(pp=2, dp=2, microbatches=2, sharding="fsdp", precision="fp8"), TINY),
    "ddp_rowwise": (ParallelConfig(dp=4, precision="fp8", fp8_recipe="rowwise"), TINY),
}


@pytest.fixture(scope="module")
def fp8_oracle():
    """A layout's reference: the oracle computes it in the layout's own arithmetic (torchao's Float8Linear on
    one process, its batch split as the layout splits it, on the engines' threads: labkit/oracle/arithmetic.py)
    from the model, seed, batch and optimizer this one gives."""
    cache = {}

    def get(cfg: ParallelConfig, model: ModelConfig):
        if model not in cache:
            cache[model] = reference(model, steps=STEPS)
        return cache[model]

    return get


@pytest.fixture(scope="module")
def runs(lab):
    cache = {}

    def get(name: str):
        if name not in cache:
            cfg, model = LAYOUTS[name]
            cache[name] = lab.run(cfg, model=model, steps=STEPS, return_params=True)
        return cache[name]

    return get


# -- one process ------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_labkits_float8_linear_is_torchaos_bit_for_bit(recipe):
    """labkit's Float8Linear (what the strategies split) and torchao's (the reference's): the same loss
    and every gradient bit for bit on one process; and fp8 is not bf16 (the casts are real)."""
    net = build_model(TINY, 0).to(torch.bfloat16)
    ours, theirs, plain = copy.deepcopy(net), copy.deepcopy(net), copy.deepcopy(net)
    assert convert(ours, recipe) == convert_torchao(theirs, recipe)
    tokens, targets = data.batch("synthetic", 0, 0, 8, TINY)
    losses = []
    for m in (ours, theirs, plain):
        loss = m(tokens, targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1] != losses[2]
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_e4m3_rounding_in_numpy_is_torchs_cast():
    """The oracle's e4m3 rounding (layout/float8.py) against torch's saturated cast, bit for bit:
    normals, subnormals (below 2^-6), ties, zero's sign and values past 448."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=gen) * s for s in (1e-4, 1e-2, 1.0, 300.0)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, 448.0, 460.0, 470.0, -1e4, 2**-10, 3 * 2**-11, 17 * 2**-4])])
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(round_e4m3(x.numpy()).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("model", [TINY, LLAMA, TINY.replace(ffn=40)], ids=["gpt", "llama", "ffn40"])
def test_the_layers_that_convert_are_the_theorys(model):
    """The engines convert what layout/float8.py says and the theory prices: the blocks' linear
    layers with both dims multiples of 16, never the head (torchtitan's filter)."""
    converted = convert(build_model(model, 0), "tensorwise")
    assert [n + ".weight" for n in converted] == float8_weights(theory.param_shapes(model))
    assert "head.proj" not in converted
    if model.ffn == 40:  # fc1 (40, 32), fc2 (32, 40): kept in bf16
        assert not any("mlp" in n for n in converted) and any("attn" in n for n in converted)


# -- on the cluster ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_trains_like_the_fp8_reference_with_the_theorys_bytes(runs, fp8_oracle, name):
    cfg, model = LAYOUTS[name]
    res = runs(name)
    ref = fp8_oracle(cfg, model)
    assert_matches(res, ref)
    print(f"\n{name}: worst error over its fp8 bound", {k: f"{v:.3f}" for k, v in margins(res, ref).items()})
    if cfg.tp == 1 and cfg.pp == 1:  # every category, every comm row, and when the CPU peak comes
        check_against_theory(res, cfg, model)
        return
    compare(res, cfg, model, world=4)  # states, activations, every comm row (theory_match.py; DTensor's: over dp)
    if cfg.torch_impl:
        return
    est = theory.estimate(cfg, model, world=4)
    for rk in res.ranks:  # and the transients
        for k in set(est.memory[rk.rank]) - {"peak", "activations", "params", "grads", "optimizer"}:
            assert rk.memory[k] == est.memory[rk.rank][k], (rk.rank, k)


def test_fsdp_gathers_one_byte_per_fp8_weight_element(runs):
    """The float8 all-gather, counted from the model alone (no theory code): in a step each unit is
    gathered twice (forward, backward), its fp8 weights at one byte an element, the rest bf16; the fp8
    weights' amaxes go in one all-reduce of 4 bytes each, beside the norm's (ours one fp32, FSDP2's one
    per parameter tensor). TINY's buffers need no padding at dp=4."""
    shapes = theory.param_shapes(TINY)
    fp8 = float8_weights(shapes)
    weights = sum(prod(s) for n, s in shapes if n in fp8)
    rest = theory.num_params(TINY) - weights
    for name, norm in (("fsdp", 4), ("fsdp2", 4 * len(shapes))):
        rows = {r["op"]: r for r in runs(name).comm_table() if r["rank"] == 0 and r["dim"] == "dp"}
        assert rows["all_gather"]["payload_bytes"] == 2 * (1 * weights + 2 * rest), name
        assert rows["all_reduce"]["payload_bytes"] == 4 * len(fp8) + norm, name


def test_tp_sp_gathers_its_inputs_in_fp8_and_keeps_them(runs):
    """Under SP the attention's and the MLP's inputs are cast before their all-gather (torchao's
    PrepareFloat8ModuleInput): the step's tp all-gathers move less than bf16's, and a rank keeps less."""
    cfg, _ = LAYOUTS["tp_sp"]
    bf16 = theory.estimate(cfg.replace(precision="bf16"), TINY, world=4)
    res = runs("tp_sp")
    gathered = lambda rows: sum(r["payload_bytes"] for r in rows if r["op"] == "all_gather" and r["rank"] == 0)
    b, s, h = cfg.global_batch // cfg.dp, TINY.seq, TINY.hidden
    # per layer two inputs, each gathered into (b, s, h) at 1 byte an element instead of 2
    assert gathered(bf16.comm_table()) - gathered(res.comm_table()) == 2 * TINY.layers * b * s * h
    assert res.ranks[0].memory["activations"] < bf16.memory[0]["activations"]


# -- the oracle catches a scale bug -----------------------------------------------------------------
def amax_of_the_local_shard(original):
    """engines/float8.py WeightScales.refresh without its all-reduce: each rank's scales from the
    amax of its own shard of each weight (the issue's mutation)."""
    import torch as t

    from labkit.engines.float8 import to_scale

    @t.no_grad()
    def refresh(self):
        for _group, entries in self.groups.items():
            if all(e.seen == [x._version for x in e.tensors] for e in entries):
                continue
            local = [e.amaxes() for e in entries]
            scales = to_scale(t.cat(local), "e4m3").split([len(a) for a in local])  # no all-reduce
            for e, s in zip(entries, scales):
                e.done(s)
                e.seen = [x._version for x in e.tensors]

    return refresh


def amax_of_rank_0(original):
    """The same, every rank agreeing on rank 0's amaxes (a broadcast for the MAX): the replicas agree."""
    import torch as t
    import torch.distributed as dist

    from labkit.engines.float8 import to_scale

    @t.no_grad()
    def refresh(self):
        for group, entries in self.groups.items():
            if all(e.seen == [x._version for x in e.tensors] for e in entries):
                continue
            local = [e.amaxes() for e in entries]
            amax = t.cat(local)
            dist.broadcast(amax, src=dist.get_global_rank(group, 0), group=group)
            for e, s in zip(entries, to_scale(amax, "e4m3").split([len(a) for a in local])):
                e.done(s)
                e.seen = [x._version for x in e.tensors]

    return refresh


@pytest.mark.parametrize("bug, first", [(amax_of_the_local_shard, "replicas"), (amax_of_rank_0, "working weights")])
def test_fsdp_scales_not_all_reduced_are_caught(lab, fp8_oracle, bug, first):
    """FSDP's fp8 weights cast with scales from part of each tensor: the working weights are not the
    masters' fp8 cast (bit for bit), and the first step's gradients leave the cast-exact bound."""
    cfg, model = LAYOUTS["fsdp"]
    ref = fp8_oracle(cfg, model)
    register(bug)  # this module by value: test_mutations' hook ships it to engines that cannot import it
    with mutated(lab, ("labkit.engines.float8", "WeightScales", "refresh"), bug):
        res = lab.run(cfg, model=model, steps=STEPS, return_params=True)
    found = mismatches(res, ref)
    checks = {m.check for m in found}
    assert found[0].check == first and {"working weights", "gradients"} <= checks, [str(m) for m in found]
    assert any("blocks.0.mlp.fc1.weight" in m.message for m in found if m.check == first)
    print(f"\n{bug.__name__}: errors over the bounds", {k: f"{v:.3g}" for k, v in margins(res, ref).items()})


# -- refused at the door ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, model, says",
    [
        (ParallelConfig(dp=4, precision="fp8", fp8_recipe="mxfp8"), TINY, "MX block scales"),
        (ParallelConfig(dp=4, precision="fp8", fp8_recipe="delayed"), TINY, "delayed scaling"),
        (ParallelConfig(ep=2, dp=2, precision="fp8"), TINY.replace(experts=4, top_k=2), "Float8GroupedExperts"),
        (ParallelConfig(cp=2, dp=2, precision="fp8"), TINY, "its own s/cp positions"),
        (ParallelConfig(tp=2, dp=2, precision="fp8", fp8_recipe="rowwise"), TINY, "tensorwise only"),
        (ParallelConfig(dp=4, impl="torch", precision="fp8"), TINY, "runs FSDP2"),
        (
            ParallelConfig(tp=2, dp=2, sharding="fsdp", impl="torch", sequence_parallel=True, precision="fp8"),
            TINY,
            "Invalid scalar type",
        ),
        (ParallelConfig(tp=2, dp=2, sharding="fsdp", precision="fp8"), TINY, "both the unit's dp group and tp"),
    ],
)
def test_what_is_not_built_is_refused_by_name(cfg, model, says):
    with pytest.raises(ConfigError, match=says):
        validate(cfg, model, 4)


def test_an_fp8_run_is_held_to_the_fp8_arithmetic_that_splits_as_it_does(runs):
    """Whatever reference is handed in (fp32, or fp8 split otherwise), the oracle computes the fp8 one that
    splits its batch as the layout does, and the verdict is the same."""
    res = runs("pp_1f1b")
    arith = arithmetic(res)
    assert (arith.precision, arith.shards, arith.microbatches, arith.shared) == ("fp8", 4, 2, True)
    plain = reference(TINY, steps=STEPS)
    other = reference(TINY, steps=STEPS, precision="fp8", shards=2)
    assert mismatches(res, plain) == mismatches(res, other) == []
    assert margins(res, plain) == margins(res, other)


@pytest.mark.parametrize("name", ["ddp", "tp_sp", "pp_1f1b", "fsdp2_tp", "ddp_rowwise"])
def test_every_rank_runs_three_fp8_matmuls_per_converted_layer(runs, name):
    """What the float8 check holds each rank to, counted from the model alone: per microbatch the forward
    matmul of every converted linear this rank holds, and its two backward ones (a tp rank its slice of
    each; a pipeline rank its stage's)."""
    cfg, model = LAYOUTS[name]
    layers = len(float8_weights(theory.param_shapes(model))) // cfg.pp
    for rk in runs(name).ranks:
        assert (
            rk.float8_matmuls
            == [{"forward": layers * cfg.microbatches, "backward": 2 * layers * cfg.microbatches}] * STEPS
        )
