"""The planner (pure, no cluster): theory.evaluate prices one layout term by term, theory.plan
ranks every layout that fits and says why the others do not (the published runs: tests/test_published.py)."""

from __future__ import annotations

import pytest

from labkit import ConfigError, ModelConfig, ParallelConfig, theory
from labkit.theory.planner.gpu_memory import TERMS
from labkit.theory.planner.hardware import H100

M = ModelConfig(layers=16, hidden=2048, heads=16, ffn=8192, vocab=32000, seq=4096)


def test_evaluate_prices_one_layout():
    cfg = ParallelConfig(dp=8, global_batch=16, sharding="fsdp", precision="bf16")
    p = theory.evaluate(cfg, M, hardware="h100")
    assert p.config == cfg and p.fits and p.bound in ("compute", "memory", "dp")
    mem = p.memory
    assert set(TERMS) <= set(mem)
    assert p.peak_bytes == mem["peak"] == pytest.approx(mem["reserved"] + mem["cuda_context"] + mem["nccl"])
    assert mem["reserved"] == pytest.approx(mem["allocated"] * (1 + H100.allocator))
    transient = max(mem["logits"], mem["recompute"] + mem["temporaries"])
    assert mem["allocated"] == pytest.approx(
        sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "gathered", "reduce_buffers")) + transient
    )
    assert p.tokens_per_second_per_gpu == pytest.approx(16 * M.seq / (p.step_seconds * 8))
    assert 0 < p.mfu < 1


def test_memory_terms():
    psi = theory.num_params(M)
    fsdp = theory.evaluate(ParallelConfig(dp=8, global_batch=16, sharding="fsdp", precision="bf16"), M).memory
    # FSDP2: fp32 shards of parameters (4) and Adam's moments (8); no gradients yet at the peak (the
    # loss's backward of the step's only microbatch); with accumulation they are there (4): 16Ψ/N
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == pytest.approx((4 * psi / 8, 0, 8 * psi / 8))
    accum = theory.evaluate(ParallelConfig(dp=8, global_batch=16, microbatches=2, sharding="fsdp", precision="bf16"), M)
    accum = accum.memory
    assert accum["params"] + accum["grads"] + accum["optimizer"] == pytest.approx(16 * psi / 8)
    zero1 = theory.evaluate(
        ParallelConfig(dp=8, global_batch=16, microbatches=2, sharding="zero1", precision="bf16"), M
    )
    zero1 = zero1.memory
    assert zero1["params"] + zero1["grads"] == 4 * psi and zero1["optimizer"] == pytest.approx(12 * psi / 8)
    tp = theory.evaluate(ParallelConfig(dp=4, tp=2, global_batch=8, sequence_parallel=True, precision="bf16"), M)
    assert tp.memory["logits"] == 8 * 2 * M.seq * M.vocab / 2  # b·s·V/tp: fp32 gradient and log_softmax's
    acts = {}
    for ac in (False, "selective", "op", True):
        acts[ac] = theory.evaluate(ParallelConfig(dp=8, global_batch=16, checkpoint_activations=ac), M).memory
    lse = 4 * 2 * M.heads * M.seq  # what selective recomputation drops per block
    assert acts[False]["activations"] - acts["selective"]["activations"] == M.layers * lse
    assert acts["selective"]["activations"] > acts["op"]["activations"] > acts[True]["activations"]
    assert acts[True]["recompute"] > 0 == acts[False]["recompute"]
    bf16, fp8 = (
        theory.evaluate(ParallelConfig(dp=8, global_batch=16, sharding="fsdp", precision=p), M).memory
        for p in ("bf16", "fp8")
    )
    assert fp8["gathered"] == bf16["gathered"] / 2  # FSDP's fp8 all-gather
    assert fp8["optimizer"] == bf16["optimizer"]  # fp32 master weights and moments either way


def test_what_does_not_fit_says_by_how_much_and_what_cannot_be_laid_out_says_why():
    big = theory.evaluate(ParallelConfig(dp=8, global_batch=8, precision="bf16"), M.replace(layers=128), "h100")
    assert not big.fits and "needs" in big.why and f"of {H100.memory / 1e9:,.0f} GB" in big.why
    with pytest.raises(ConfigError, match="heads=16 is not divisible by tp=3"):
        theory.evaluate(ParallelConfig(tp=3), M)
    with pytest.raises(ConfigError, match="hardware='tpu'"):
        theory.evaluate(ParallelConfig(), M, hardware="tpu")
    # production frameworks run FSDP under a pipeline (torchtitan); the planner prices it
    assert theory.evaluate(ParallelConfig(dp=2, pp=4, microbatches=8, global_batch=16, sharding="fsdp"), M).fits


def test_plan_ranks_what_fits_and_explains_the_rest():
    plans = theory.plan(M, 64, global_batch=128, top=5, precision="bf16")
    assert 0 < len(plans) <= 5 and plans.timed >= len(plans)
    speeds = [p.tokens_per_second_per_gpu for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in plans:
        assert p.fits and p.config.world == 64 and p.config.global_batch == 128 and p.config.precision == "bf16"
        again = theory.evaluate(p.config, M)
        assert again.tokens_per_second_per_gpu == p.tokens_per_second_per_gpu and again.peak_bytes == p.peak_bytes
    tight = theory.plan(M.replace(layers=256), 8, global_batch=8, precision="bf16")
    assert tight.counts and all(r.reason.startswith("does not fit: needs") for r in tight.rejected)
    assert tight.rejected == sorted(tight.rejected, key=lambda r: float(r.reason.split("needs ")[1].split(" GB")[0]))


def test_plan_405b_on_16k_gpus():
    """How fast is a benchmark's question (benchmarks/speed.py, its numbers in benchmarks/RESULTS.md):
    a speed bound in the suite fails on a slower machine, not on a slower planner."""
    from labkit.theory.presets import LLAMA_405B

    plans = theory.plan(LLAMA_405B, 16384, global_batch=2048)
    assert plans
    assert any(getattr(p.config, "stage_layers", ()) for p in plans) or plans[0].config.pp == 1


def _held(p, fixed: dict) -> bool:
    return all(getattr(p.config, k) == v for k, v in fixed.items())


@pytest.mark.parametrize(
    "fixed",
    [{"tp": 2, "sharding": "zero1"}, {"pp": 2, "schedule": "1f1b"}, {"dp": 4, "microbatches": 4}, {"cp": 2}],
    ids=str,
)
def test_a_fixed_search_finds_the_best_layout_that_holds_it(fixed):
    # with `top` past the number of layouts nothing is pruned by time: every layout that fits is
    # timed, so the best one holding `fixed` is known, and the held search must find exactly it
    everything = theory.plan(M, 16, global_batch=32, top=100_000, precision="bf16")
    holding = [p for p in everything if _held(p, fixed)]
    found = theory.plan(M, 16, global_batch=32, top=5, precision="bf16", fixed=fixed)
    assert holding and found and all(_held(p, fixed) for p in found)
    assert found[0].tokens_per_second_per_gpu == pytest.approx(holding[0].tokens_per_second_per_gpu)
    assert found[0].tokens_per_second_per_gpu <= everything[0].tokens_per_second_per_gpu


def test_fixed_schedules_checkpointing_and_bad_fields():
    found = theory.plan(
        M, 16, global_batch=32, top=3, fixed={"pp": 4, "schedule": "gpipe", "checkpoint_activations": "full"}
    )
    assert found and all(p.config.schedule == "gpipe" and p.config.pp == 4 for p in found)
    assert all(p.config.checkpoint_activations is True for p in found)
    inter = theory.plan(M, 16, global_batch=32, top=3, fixed={"pp": 2, "schedule": "interleaved"})
    assert inter and all(p.config.virtual_stages in (2, 4) for p in inter)
    with pytest.raises(ConfigError, match=r"fixed=\['tensor'\] cannot be held.*dp, tp, pp"):
        theory.plan(M, 16, fixed={"tensor": 2})
