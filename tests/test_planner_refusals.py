"""The planner refuses what it cannot price: a precision the hardware has no rate for,
a held field ParallelConfig refuses, top < 1, global_batch < 1, each with its own message naming the
value and a fix; an empty answer always says why; `labkit plan` prints messages, never tracebacks;
every layout it prices passes the validation; and no MFU above 100% anywhere (a fuzz over held
fields, hardware, precisions and models)."""

from __future__ import annotations

import random

import pytest

from labkit import ConfigError, ModelConfig, ParallelConfig, theory
from labkit.cli import main
from labkit.theory.planner.evaluate import layout_problems
from labkit.theory.planner.hardware import HARDWARE
from labkit.theory.presets import LLAMA31_8B, LLAMA32_1B

SMALL = ModelConfig(arch="llama", layers=8, hidden=512, heads=8, kv_heads=4, ffn=1536, vocab=8192, seq=1024)


def _refused(match: str, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        theory.plan(**{"model": LLAMA31_8B, "gpus": 8, **kw})
    assert match in str(e.value), str(e.value)
    return str(e.value)


def test_fp8_on_hardware_without_an_fp8_rate_is_refused_naming_it():
    msg = _refused("cannot be priced on A100", hardware="a100", precision="fp8")
    assert "use precision='bf16'" in msg and "h100" in msg
    with pytest.raises(ConfigError, match="no fp8 rate"):
        theory.evaluate(ParallelConfig(dp=8, global_batch=8, precision="fp8"), LLAMA31_8B, "a100")
    # the exact estimate's step time goes through the same door
    with pytest.raises(ConfigError, match="A100"):
        theory.estimate(ParallelConfig(dp=2, global_batch=2, precision="fp8"), SMALL).step_time(HARDWARE["a100"])
    # and the hardware that has the rate still prices it
    assert theory.evaluate(ParallelConfig(dp=8, global_batch=8, precision="fp8"), LLAMA31_8B, "h100").mfu > 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top=0), "top=0 must be a positive integer"),
        (dict(top=-1), "top=-1 must be a positive integer"),
        (dict(global_batch=0), "global_batch=0 must be a positive integer"),
        (dict(global_batch=-8), "global_batch=-8 must be a positive integer"),
        (dict(precision="fp32"), "the planner prices bf16 and fp8"),
        (dict(precision="int4"), "the planner prices bf16 and fp8"),
        (dict(fixed={"sharding": "bogus"}), "'none', 'zero1', 'zero2', 'zero3', 'fsdp'"),
        (dict(fixed={"schedule": "bogus"}), "'gpipe', '1f1b'"),
        (dict(fixed={"checkpoint_activations": "bogus"}), "'selective', 'op'"),
        (dict(fixed={"tp": "abc"}), "tp='abc' must be a whole number"),
        (dict(fixed={"dp": 0}), "dp=0 must be a positive integer"),
        (dict(fixed={"virtual_stages": 0}), "virtual_stages=0 must be a positive integer"),
        (dict(fixed={"sequence_parallel": "maybe"}), "must be True or False"),
        (dict(fixed={"precision": "bf16"}), "cannot be held by the planner"),
    ],
)
def test_bad_arguments_are_refused_each_with_its_own_message(kw, match):
    _refused(match, **kw)


@pytest.mark.parametrize(
    "fixed, why",
    [
        ({"tp": 3}, "tp=3 does not divide 8 GPUs"),
        ({"tp": 16}, "tp=16 does not divide 8 GPUs"),
        ({"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1}, "uses 4 of the 8 GPUs"),
        ({"microbatches": 7}, "microbatches=7 does not divide the sequences per data rank"),
    ],
)
def test_an_empty_answer_says_why(fixed, why):
    plans = theory.plan(LLAMA31_8B, 8, global_batch=64, fixed=fixed)
    assert not plans and why in plans.why, plans.why


def test_nothing_fits_says_so_with_the_nearest_miss():
    plans = theory.plan(LLAMA31_8B.replace(layers=320), 8, global_batch=8, fixed={"tp": 8})
    assert not plans and "does not fit in memory" in plans.why and plans.rejected


def test_the_why_check_fails_on_a_list_that_is_not_empty():
    plans = theory.plan(SMALL, 8, global_batch=16, top=3)
    assert plans and plans.why == ""


@pytest.mark.parametrize(
    "argv, says",
    [
        ("--hardware a100 --precision fp8", "no fp8 rate"),
        ("--fix sharding=bogus", "sharding='bogus' is not one of"),
        ("--top 0", "top=0"),
        ("--top -1", "top=-1"),
        ("--global-batch 0", "global_batch=0"),
        ("--fix tp=abc", "tp='abc' must be a whole number"),
        ("--fix tp=-2", "tp=-2 must be a positive integer"),
        ("--fix checkpoint_activations=bogus", "checkpoint_activations='bogus'"),
        ("--fix schedule=bogus", "schedule='bogus'"),
        ("--fix precision=fp8", "cannot be held"),
        ("--fix tp", "write FIELD=VALUE"),
    ],
)
def test_the_cli_prints_messages_never_tracebacks(argv, says, capsys):
    rc = main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", *argv.split()])
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err


def test_the_cli_says_why_nothing_is_ranked(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--fix", "tp=3"]) == 0
    out = capsys.readouterr().out
    assert "nothing to rank: " in out and "tp=3 does not divide 8 GPUs" in out, out


FUZZ_FIELDS = {
    "dp": [1, 2, 3, 4, 8, 0, -1, "x"],
    "tp": [1, 2, 3, 4, 8, 16, 0, "abc", 2.0],
    "pp": [1, 2, 4, 3, 0],
    "cp": [1, 2, 4, 0],
    "ep": [1, 2],
    "sharding": ["none", "zero1", "zero2", "zero3", "fsdp", "bogus"],
    "schedule": ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev", "bogus"],
    "virtual_stages": [1, 2, 4, 0],
    "microbatches": [1, 2, 4, 7, 0],
    "checkpoint_activations": [False, True, "none", "full", "selective", "op", "bogus"],
    "sequence_parallel": [True, False, "maybe"],
}


def test_fuzz_never_an_mfu_above_100_percent_nor_an_unnamed_error():
    """Held fields, hardware, precisions, stacks, models, GPU counts, top and global_batch drawn at random
    (valid and not): every call returns ranked plans, or an empty list that says why, or a
    ConfigError; every plan passes the validation and has 0 < MFU <= 100%."""
    rng = random.Random(29)
    models = [SMALL, LLAMA32_1B, LLAMA31_8B, SMALL.replace(seq=32768), LLAMA31_8B.replace(seq=131072)]
    outcomes = {"plans": 0, "empty": 0, "refused": 0}
    for _ in range(300):
        fixed = {k: rng.choice(v) for k, v in rng.sample(sorted(FUZZ_FIELDS.items()), rng.randint(0, 3))}
        kw = dict(
            model=rng.choice(models),
            gpus=rng.choice([1, 2, 8, 16, 64]),
            hardware=rng.choice(list(HARDWARE)),
            precision=rng.choice([None, "bf16", "fp8", "fp32"]),
            top=rng.choice([1, 3, 5, 0]),
            global_batch=rng.choice([None, 8, 64, 0]),
            fixed=fixed,
            stack=rng.choice(["eager", "compile", "roofline"]),
        )
        try:
            plans = theory.plan(**kw)
        except ConfigError as e:
            assert str(e).strip(), kw
            outcomes["refused"] += 1
            continue
        if not plans:
            assert plans.why, kw
            outcomes["empty"] += 1
        outcomes["plans"] += bool(plans)
        for p in plans:
            assert 0 < p.mfu <= 1.0, (kw, p.layout(), p.mfu)
            assert not layout_problems(p.config, kw["model"]), (kw, p.layout())
    # the fuzz reached all three outcomes (else it tests less than it says)
    assert all(outcomes.values()), outcomes


def test_evaluate_never_shows_an_mfu_above_100_percent():
    """Every precision on every hardware over layouts that stress the count: long sequences (where
    the model FLOPs count attention's whole square), fp8, big microbatches."""
    worst = 0.0
    for name, hw in HARDWARE.items():
        for precision in ("fp32", "bf16", "fp8"):
            for model in (LLAMA31_8B, LLAMA31_8B.replace(seq=262144), SMALL, SMALL.replace(seq=65536)):
                for dp, tp, cp, gb in ((8, 1, 1, 64), (1, 8, 1, 8), (1, 1, 8, 1), (2, 2, 2, 16)):
                    cfg = ParallelConfig(dp=dp, tp=tp, cp=cp, global_batch=gb, precision=precision, sharding="fsdp")
                    if layout_problems(cfg, model):
                        continue
                    try:
                        # the roofline stack is the fastest: the MFU's worst case
                        p = theory.evaluate(cfg, model, name, stack="roofline")
                    except ConfigError as e:
                        assert precision == "fp8" and not hw.fp8_flops and "no fp8 rate" in str(e)
                        continue
                    worst = max(worst, p.mfu)
                    assert 0 < p.mfu <= 1.0, (name, precision, model.seq, cfg, p.mfu)
    assert worst > 0.3  # the sweep priced real steps
