"""The oracle's own checks on synthetic RunResults (no cluster): a result built from the reference
itself passes, and each kind of wrong result fails with a message naming the step, rank or tensor.
tests/test_mutations.py injects the same kinds of bugs into the real strategies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import TINY

from labkit import OptimConfig, ParallelConfig, reference
from labkit.oracle.arithmetic import arithmetic
from labkit.oracle.assembly import assemble
from labkit.oracle.bounds import FP32, UNIT_ROUNDOFF, bounds, layout_roundings, one_process, round_to, tensor_errors
from labkit.oracle.checks import assert_matches, mismatches
from labkit.oracle.held import judged
from labkit.oracle.reference import train
from labkit.results.run import RankReport, RunResult

STEPS = 2


class _Own:
    """A `follow` that applies the reference's own gradients: the plain reference, every step's gradients kept."""

    record = None

    def install(self, module, step):
        pass

    def shard(self, index, count, size):
        pass

    def norm(self, step):
        return None  # clipped by its own

    def __init__(self, precision: str = "fp32"):
        self.precision = precision  # bf16: each step applies its gradients rounded into bf16, as a rank does

    def grads(self, step, names, own):
        if self.precision == "fp32":
            return own
        return [g.to(torch.bfloat16).float() for g in own]


@pytest.fixture(scope="module")
def ref():
    return train(TINY, STEPS, 0, 8, "fp32", OptimConfig(), 1, "synthetic", follow=_Own())


def faithful(ref, ranks: int = 2, precision: str = "fp32", threads: int = 0) -> RunResult:
    """A result that is the reference, held by `ranks` data-parallel ranks (whole replicas) that report
    `threads` (0: none, as a result from before the ranks said)."""
    pieces = [
        {"name": n, "shape": list(v.shape), "box": None, "flat": None, "values": v.copy(), "rank": r}
        for r in range(ranks)
        for n, v in ref.params.items()
    ]
    params, issues = assemble(pieces)
    reports = [
        RankReport(
            rank=r,
            coords={"tp": 0, "cp": 0, "ep": 0, "dp": r, "pp": 0},
            host="here",
            device="cpu",
            memory={},
            comm=[],
            timeline=[],
            losses=list(ref.losses),
            grad_norms=list(ref.grad_norms),
            threads=threads,
        )
        for r in range(ranks)
    ]
    step_grads = [{n: g.copy() for n, g in grads.items()} for grads in ref.step_grads]
    return RunResult(
        config=ParallelConfig(dp=ranks, precision=precision),
        model=TINY,
        steps=STEPS,
        seed=0,
        losses=list(ref.losses),
        ranks=reports,
        params=params,
        grads=step_grads[0],
        step_grads=step_grads,
        compute={n: round_to(v, precision) for n, v in params.items()} if precision != "fp32" else None,
        piece_issues=issues,
    )


def checks_of(res, ref) -> list[str]:
    return [m.check for m in mismatches(res, ref)]


def test_the_reference_itself_matches(ref):
    assert mismatches(faithful(ref), ref) == []
    assert mismatches(faithful(ref, precision="bf16"), ref) == []  # bf16 masters, working copies rounded


def test_a_nan_loss_after_the_first_step_fails(ref):
    """Python's max skips a NaN that is not first, and nan > rtol is False: both were holes."""
    res = faithful(ref)
    res.losses[1] = math.nan
    found = mismatches(res, ref)
    assert {m.check for m in found} == {"finite", "losses"}
    assert "step(s) [1]" in str(found[0]) and "step 1: nan" in str(found[1])


def test_a_nan_gradient_norm_on_one_rank_fails(ref):
    res = faithful(ref)
    res.ranks[1].grad_norms[1] = math.nan
    found = [str(m) for m in mismatches(res, ref)]
    assert any("rank 1's gradient norm is not finite at step(s) [1]" in m for m in found)
    assert any(m.startswith("[grad norms] rank 1's") for m in found)


def test_a_nan_parameter_element_on_one_rank_fails(ref):
    pieces = [
        {"name": n, "shape": list(v.shape), "box": None, "flat": None, "values": v.copy(), "rank": r}
        for r in range(2)
        for n, v in ref.params.items()
    ]
    pieces[-1]["values"].reshape(-1)[3] = np.nan  # rank 1's copy of the last tensor
    res = faithful(ref)
    res.params, res.piece_issues = assemble(pieces)
    found = [str(m) for m in mismatches(res, ref)]
    name = pieces[-1]["name"]
    assert f"[finite] parameters {name}: 1 non-finite element(s) on rank 1" in found
    assert any(m.startswith(f"[replicas] parameters {name}: rank 1's copy differs from rank 0's") for m in found)


def test_a_nan_in_the_assembled_parameters_fails_without_replicas(ref):
    res = faithful(ref, ranks=1)
    res.params["head.norm.bias"][0] = np.nan
    assert "parameters" in checks_of(res, ref)  # the whole-model error is NaN: over every bound


def test_a_missing_step_fails(ref):
    res = faithful(ref)
    res.losses.pop()
    res.ranks[0].grad_norms.pop()
    found = [str(m) for m in mismatches(res, ref)]
    assert "[steps] 1 losses for 2 steps; the reference has 2" in found
    assert "[steps] rank 0 reported 1 gradient norms, not 2" in found


def test_a_replica_that_differs_is_named_with_its_ranks(ref):
    """Assembling used to let the last rank's copy win: now every copy is compared with the first."""
    w = ref.params["blocks.0.ln1.weight"]
    pieces = [
        {"name": "blocks.0.ln1.weight", "shape": [32], "box": None, "flat": None, "values": w.copy(), "rank": r}
        for r in range(4)
    ]
    pieces[3]["values"][5] = np.nextafter(w[5], np.float32(2))  # one ulp, on rank 3
    ulp = float(pieces[3]["values"][5]) - float(w[5])
    _, issues = assemble(pieces)
    assert [str(i) for i in issues] == [
        "parameters blocks.0.ln1.weight: rank 3's copy differs from rank 0's in 1 element(s) "
        f"(largest |difference| {ulp:.3g})"
    ]


def test_pieces_that_leave_a_hole_are_refused():
    with pytest.raises(ValueError, match="not fully covered"):
        assemble([{"name": "w", "shape": [4], "box": None, "flat": [0, 3], "values": np.zeros(3), "rank": 0}])


def test_flat_ranges_of_boxes_land_where_they_belong():
    """A ZeRO shard of a TP slice: a flat range of the box."""
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    box = [[0, 4], [3, 6]]  # columns 3..5
    pieces = [
        {"name": "w", "shape": [4, 6], "box": [[0, 4], [0, 3]], "flat": None, "values": full[:, :3], "rank": 0},
        {"name": "w", "shape": [4, 6], "box": box, "flat": [0, 7], "values": full[:, 3:].reshape(-1)[:7], "rank": 1},
        {"name": "w", "shape": [4, 6], "box": box, "flat": [7, 12], "values": full[:, 3:].reshape(-1)[7:], "rank": 2},
    ]
    out, issues = assemble(pieces)
    assert issues == [] and np.array_equal(out["w"], full)


def test_a_localized_gradient_bug_in_one_small_tensor_fails(ref):
    """A 1% error in one LayerNorm bias's gradient (32 elements) is invisible to the global norm
    and the whole model; the per-tensor check names the tensor (its gradient is below the floor,
    so the error reads 6.6e-4 of the floored scale: still 66 times the bound)."""
    res = faithful(ref)
    res.grads["blocks.1.ln2.bias"] = res.grads["blocks.1.ln2.bias"] * 1.01
    found = mismatches(res, ref)
    assert [m.check for m in found] == ["gradients"]
    assert found[0].message.startswith("blocks.1.ln2.bias: step 0's reduced gradient is 0.00066")


def test_a_gradient_bug_at_a_later_step_fails_at_that_step(ref):
    """Every step's gradients are held, tensor by tensor, against the replayed reference's: a bug that
    shows only once the optimizer has stepped (a stale gradient, a bucket reused) is named at its step."""
    res = faithful(ref)
    res.step_grads[1]["blocks.0.mlp.fc1.weight"] = res.step_grads[1]["blocks.0.mlp.fc1.weight"] * 1.01
    found = mismatches(res, ref)
    assert found and found[0].check == "gradients"
    head, _, rest = found[0].message.partition(" is ")
    assert head == "blocks.0.mlp.fc1.weight: step 1's reduced gradient" and float(rest.split()[0]) > 100 * FP32.grads


def test_a_run_without_its_gradients_is_held_on_its_first_step_alone(ref):
    """No replay without the run's gradients: after an update AdamW has amplified a rounding, so only the
    first step's loss and norm can be held (labkit/oracle/replay.py)."""
    res = faithful(ref)
    res.step_grads, res.grads, res.params = None, None, None
    res.losses[1] *= 1.01  # a later step: not held
    assert mismatches(res, ref) == []
    res.losses[0] *= 1.01
    assert [m.check for m in mismatches(res, ref)] == ["losses"]


def test_the_floor_holds_a_near_zero_tensor_to_the_whole_gradients_scale(ref):
    """A tensor whose gradient is exactly zero may carry rounding of the size the whole gradient
    would put on its elements, and no more."""
    grads = {n: g.copy() for n, g in ref.first_grads.items()}
    zero = {n: np.zeros_like(g) if n == "head.norm.bias" else g for n, g in grads.items()}
    total = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in zero.values()))
    psi = sum(g.size for g in zero.values())
    scale = total * math.sqrt(zero["head.norm.bias"].size / psi)
    for size, ok in ((0.5 * FP32.grads * scale, True), (2 * FP32.grads * scale, False)):
        got = dict(zero, **{"head.norm.bias": np.full(32, size / math.sqrt(32), dtype=np.float32)})
        err, allowed = tensor_errors(got, zero)["head.norm.bias"]
        assert allowed == pytest.approx(scale) and (err <= FP32.grads * allowed) is ok


def test_stale_working_weights_fail(ref):
    res = faithful(ref, precision="bf16")
    res.compute["embed.tok.weight"] = res.compute["embed.tok.weight"].copy()
    res.compute["embed.tok.weight"][0, 0] += 0.5
    found = mismatches(res, ref)
    assert [m.check for m in found] == ["working weights"]
    assert found[0].message.startswith("embed.tok.weight: 1 of 4096 element(s) differ from the masters rounded to bf16")


def test_bf16_bounds_count_the_roundings_of_each_gradients_chain():
    """One u per rounding on the longest chain to a gradient, counted on the computation: more than the
    hand count's 2L + 4 (which a correct run crossed), more with more layers, the embedding's the longest."""
    u = UNIT_ROUNDOFF["bf16"]
    two, four = one_process(TINY), one_process(TINY.replace(layers=4))
    assert min(two.values()) > 2 * TINY.layers + 4
    assert max(four.values()) > max(two.values())
    assert max(two, key=two.get).startswith("embed.")
    b = bounds("bf16", {"a": 10, "b": 20})
    assert b.grad("a") == pytest.approx(10 * u) and b.grad_norms == pytest.approx(20 * u) and b.losses == 1e-3
    assert bounds("fp32") == FP32
    # a layout's own roundings: the reduction's, accumulation's, tensor parallelism's partial sums
    assert layout_roundings(ParallelConfig(dp=2), 2) == 1
    assert layout_roundings(ParallelConfig(dp=2, microbatches=4), 2) == 4
    assert layout_roundings(ParallelConfig(tp=2), 2) == 1 + 4 * 2


def test_the_oracle_computes_the_runs_arithmetic_whatever_the_reference_did(ref):
    """The reference handed in gives the model, seed, batch and optimizer; the precision and the batch split
    are the run's (labkit/oracle/arithmetic.py): a bf16 or a split reference judges alike."""
    res = faithful(ref)
    assert mismatches(res, reference(TINY, steps=STEPS, precision="bf16")) == []
    assert mismatches(res, reference(TINY, steps=STEPS, shards=2)) == []


@pytest.fixture(scope="module")
def bf16_ranks():
    """Two data ranks' bf16 arithmetic on one process, every step's gradients kept: the sum of their shards'
    bf16 gradients in fp32, as each rank computes them (this process's threads, as a rank's would be)."""
    held = train(TINY, STEPS, 0, 8, "bf16", OptimConfig(), 2, "synthetic", follow=_Own("bf16"), spread=True)
    return held, torch.get_num_threads()


def shared_result(ref, held, threads) -> RunResult:
    """A dp=2 bf16 run whose reduced gradients are `held`'s rounded into bf16, as the ranks round theirs."""
    res = faithful(ref, precision="bf16", threads=threads)
    res.step_grads = [{n: round_to(g, "bf16") for n, g in grads.items()} for grads in held.step_grads]
    res.grads = res.step_grads[0]
    for rk in res.ranks:
        rk.losses, rk.grad_norms = list(held.losses), list(held.grad_norms)
    res.losses = list(held.losses)
    return res


def test_a_shared_arithmetic_run_is_held_to_one_rounding(ref, bf16_ranks):
    """Where the reference computes the run's every rounding (dp on this process's CPU threads), a bf16
    run is allowed its reduction's rounding alone: its gradients rounded into bf16 pass (within u per
    element), one tensor 1% off does not, and the bound is ~2^-8 relative, not the chain's 10-30%."""
    held, threads = bf16_ranks
    res = shared_result(ref, held, threads)
    assert arithmetic(res).shared
    found = [m for m in mismatches(res, ref) if m.check in ("gradients", "losses", "grad norms")]
    assert found == [], [str(m) for m in found]
    _, b = judged(res, ref)
    assert max(b.grad(n, 0) for n in held.step_grads[0]) <= 1.01 * UNIT_ROUNDOFF["bf16"]
    res.step_grads[0]["blocks.0.mlp.fc1.weight"] = res.step_grads[0]["blocks.0.mlp.fc1.weight"] * 1.01
    found = mismatches(res, ref)
    assert found and found[0].check == "gradients" and "blocks.0.mlp.fc1.weight: step 0" in found[0].message


def test_a_run_that_computed_in_another_precision_fails_the_shared_bound(ref):
    """The fp32 reference's own gradients, said to be a bf16 run's: bf16's one rounding does not hold them."""
    res = faithful(ref, precision="bf16", threads=torch.get_num_threads())
    assert arithmetic(res).shared and "gradients" in checks_of(res, ref)


def test_assert_matches_lists_every_mismatch(ref):
    res = faithful(ref)
    res.losses[0] *= 1.001
    res.ranks[0].grad_norms[0] *= 2
    with pytest.raises(AssertionError, match=r"2 mismatch\(es\)") as info:
        assert_matches(res, ref)
    assert "[losses]" in str(info.value) and "[grad norms] rank 0's" in str(info.value)
