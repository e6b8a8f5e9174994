"""Config validation: every ConfigError path, with the numbers and a fix in its message."""

from __future__ import annotations

import pytest

from labkit import ConfigError, ModelConfig, OptimConfig, ParallelConfig, validate
from labkit.config.validation import problems

M = ModelConfig()


def only(cfg=None, model=M, engines=8):
    cfg = ParallelConfig() if cfg is None else cfg
    found = problems(cfg, model, engines)
    assert len(found) == 1, found
    return found[0]


def test_default_is_valid():
    validate(ParallelConfig(), M, 1)
    validate(ParallelConfig(dp=4, microbatches=2), M, 4)
    assert problems(ParallelConfig(dp=2, tp=2, pp=2, microbatches=2), M, 8) == []


def test_built_strategies_are_not_refused():
    """Every strategy alone is built: none of them is reported as not built, and each validates."""
    from labkit.config.validation import not_built_yet

    for cfg, model in [
        (ParallelConfig(sharding="zero1"), M),
        (ParallelConfig(precision="bf16"), M),
        (ParallelConfig(precision="fp8"), M),
        (ParallelConfig(precision="fp8", fp8_recipe="rowwise"), M),
        (ParallelConfig(checkpoint_activations=True), M),
        (ParallelConfig(tp=2), M),
        (ParallelConfig(cp=2), M),
        (ParallelConfig(ep=2), ModelConfig(experts=2)),
        (ParallelConfig(pp=2), M),
    ]:
        assert not_built_yet(cfg, model) == [], cfg
        validate(cfg, model, 8)


@pytest.mark.parametrize(
    "cfg, model",
    [
        (ParallelConfig(tp=2, pp=2, microbatches=2, impl="torch"), M),
        (ParallelConfig(tp=2, impl="torch"), ModelConfig(experts=2)),
    ],
    ids=["torch-tp-pp", "torch-tp-moe"],
)
def test_unbuilt_combinations_are_refused_with_a_way_out(cfg, model):
    from labkit.config.validation import not_built_yet

    lines = not_built_yet(cfg, model)
    assert len(lines) == 1
    for line in lines:
        assert "not built yet" in line and ("use" in line or "set" in line), line
    with pytest.raises(ConfigError, match="not built yet"):
        validate(cfg, model, 8)


@pytest.mark.parametrize(
    "cls, value",
    [
        (ParallelConfig, ParallelConfig(dp=2, tp=2, sharding="zero1")),
        (ModelConfig, ModelConfig(experts=4, top_k=2)),
        (OptimConfig, OptimConfig(lr=1e-4)),
    ],
)
def test_round_trip_through_plain_dict(cls, value):
    d = value.to_dict()
    assert all(isinstance(v, (int, float, str, bool)) for v in d.values())
    assert cls.from_dict(d) == value


def test_unknown_field_in_dict_is_refused():
    with pytest.raises(ConfigError, match="no field"):
        ParallelConfig.from_dict({"dp": 2, "dpp": 2})


def test_too_many_ranks_names_the_product():
    msg = only(ParallelConfig(dp=2, tp=4), engines=4)
    assert "dp(2) * tp(4) * pp(1) * cp(1) * ep(1) = 8 > engines(4)" in msg


def test_heads_not_divisible_by_tp_suggests_divisors():
    msg = only(ParallelConfig(tp=3), ModelConfig(heads=4, hidden=64, ffn=255, vocab=255))
    assert "heads=4 is not divisible by tp=3" in msg and "try 1, 2 or 4" in msg


def test_ffn_and_vocab_must_split_over_tp():
    assert "ffn=101" in only(ParallelConfig(tp=2), ModelConfig(ffn=101))
    assert "vocab=255" in only(ParallelConfig(tp=2), ModelConfig(vocab=255))


def test_hidden_heads():
    assert "hidden=64 is not divisible by heads=3" in only(model=ModelConfig(heads=3))


def test_layers_vs_pipeline_chunks():
    msg = only(ParallelConfig(pp=3), ModelConfig(layers=4))
    assert "layers=4 cannot be split into pp(3) * virtual_stages(1) = 3" in msg and "try 1, 2 or 4" in msg


def test_seq_vs_ring_attention_halves():
    assert "seq=64 is not divisible by 2*cp=6" in only(ParallelConfig(cp=3))


def test_experts_and_ep():
    assert "ep=2 needs an MoE model" in only(ParallelConfig(ep=2))
    assert "experts=3 is not divisible by ep=2" in only(ParallelConfig(ep=2), ModelConfig(experts=3))
    assert "top_k=3 must be between 1 and experts=2" in only(model=ModelConfig(experts=2, top_k=3))
    with pytest.raises(ConfigError, match="experts=-1"):  # refused when built
        ModelConfig(experts=-1)


def test_global_batch_split():
    msg = only(ParallelConfig(dp=4, microbatches=3, global_batch=8))
    assert "dp(4) * ep(1) * microbatches(3) = 12" in msg and "try global_batch=12" in msg


@pytest.mark.parametrize(
    "field, value",
    [
        ("sharding", "zero4"),
        ("schedule", "2f2b"),
        ("impl", "jax"),
        ("precision", "fp16"),
        ("checkpoint_activations", "some"),
    ],
)
def test_unknown_names(field, value):
    with pytest.raises(ConfigError) as e:  # refused when built
        ParallelConfig(**{field: value})
    (msg,) = e.value.problems
    assert f"{field}={value!r} is not one of" in msg


def test_the_engines_refuse_what_only_the_theory_predicts():
    """MXFP8, delayed scaling and torchtitan's per-op checkpointing: valid layouts (the theory prices
    them), refused by the engines before any work, each by name with its reason."""
    for cfg, reason in (
        (ParallelConfig(precision="fp8", fp8_recipe="mxfp8"), "MX block scales"),
        (ParallelConfig(precision="fp8", fp8_recipe="delayed"), "delayed scaling"),
        (ParallelConfig(checkpoint_activations="op"), "per-op selective policy"),
    ):
        assert problems(cfg, M) == []
        with pytest.raises(ConfigError, match=reason):
            validate(cfg, M)
    assert ParallelConfig(checkpoint_activations=True).recompute == "full"
    assert ParallelConfig(checkpoint_activations="selective").recompute == "selective"
    validate(ParallelConfig(checkpoint_activations="selective"), M)


def built(cls, **fields) -> str:
    """The one problem `cls(**fields)` is refused with when built."""
    with pytest.raises(ConfigError) as e:
        cls(**fields)
    assert len(e.value.problems) == 1, e.value.problems
    return e.value.problems[0]


def test_order_must_name_every_dim_once():
    assert "order='tp-dp-pp'" in built(ParallelConfig, order="tp-dp-pp")
    assert "order=" in built(ParallelConfig, order="tp-tp-ep-dp-pp")


def test_degrees_must_be_positive_ints():
    assert "dp=0 must be a positive integer" in built(ParallelConfig, dp=0)
    assert "tp=1.5" in built(ParallelConfig, tp=1.5)


def test_model_sizes_must_be_positive():
    assert "model layers=0" in only(model=ModelConfig(layers=0))


def test_schedule_constraints():
    assert "needs virtual_stages >= 2" in only(ParallelConfig(pp=2, schedule="interleaved", microbatches=2))
    assert "only applies to schedule='interleaved'" in only(
        ParallelConfig(pp=2, virtual_stages=2), ModelConfig(layers=4)
    )
    assert "multiple of pp" in only(
        ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2, microbatches=3, global_batch=6)
    )


def test_sequence_parallel_needs_tp():
    assert "sequence_parallel=True needs tp > 1" in only(ParallelConfig(sequence_parallel=True))


def test_microbatches_and_bucket():
    assert "microbatches=0" in built(ParallelConfig, microbatches=0)
    assert "bucket_mb=0" in built(ParallelConfig, bucket_mb=0)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError) as e:  # when built: every wrong field at once
        ParallelConfig(dp=0, sharding="zero9", bucket_mb=0)
    assert len(e.value.problems) == 3
    with pytest.raises(ConfigError) as e:
        validate(ParallelConfig(dp=3, tp=3), ModelConfig(heads=4), 4)
    assert len(e.value.problems) >= 3
    assert isinstance(e.value, ValueError)
    assert "3 problem(s)" in str(e.value) or f"{len(e.value.problems)} problem(s)" in str(e.value)
