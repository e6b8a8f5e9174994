"""At construction, each field alone (the configs' __post_init__ runs `check_fields`): a field's type or a
choice among its Literal's values (field_types.py reads the annotations), and a range that needs no
other field; each problem naming the field, the value and a fix. Across fields and against the world:
validation.py.
"""

from __future__ import annotations

import operator
import typing

from labkit.config.base import REPLACING
from labkit.config.choices import DIMS, ConfigError
from labkit.config.field_types import field_tests, typed_fields

# -- at construction: each field alone ----------------------------------------------------------


def _at_least(low: int, name: str, fix: str, prefix: str = "") -> tuple:
    says = "a positive integer" if low == 1 else f">= {low}"
    return (lambda v: v >= low), (lambda v: f"{prefix}{name}={v!r} must be {says}; {fix}")


def _above_zero(name: str, fix: str, prefix: str = "") -> tuple:
    return (lambda v: v > 0), (lambda v: f"{prefix}{name}={v!r} must be > 0; {fix}")


def _names_every_dim(order: str) -> bool:
    return sorted(order.split("-")) == sorted(DIMS)


_EVERY_DIM = f"must name each of {'-'.join(DIMS)} exactly once, innermost first; try {'-'.join(DIMS)!r}"
_ROPE = "rope_scaling."
_RANGES = {
    "ModelConfig": {
        # 0 blocks: a model's embedding and head alone, which the theory prices; `problems` wants one
        "layers": _at_least(0, "layers", "try layers=4", "model "),
        "hidden": _at_least(1, "hidden", "try hidden=64", "model "),
        "heads": _at_least(1, "heads", "try heads=4", "model "),
        "ffn": _at_least(1, "ffn", "try ffn=256", "model "),
        "vocab": _at_least(1, "vocab", "try vocab=256", "model "),
        "seq": _at_least(1, "seq", "try seq=64", "model "),
        "experts": _at_least(0, "experts", "0 keeps dense MLPs"),
        "top_k": _at_least(1, "top_k", "the experts each token is routed to; try 1"),
        "aux_loss_coef": ((lambda v: v >= 0), lambda v: f"aux_loss_coef={v} must be >= 0; try 0.01"),
        "kv_heads": ((lambda v: v is None or v >= 1), lambda v: f"kv_heads={v} must be >= 1, or None (= heads)"),
        "vocab_divisible_by": ((lambda v: v is None or v >= 1), lambda v: f"vocab_divisible_by={v} must be >= 1"),
        "rope_theta": _above_zero("rope_theta", "RoPE's base: try 10000.0 (Llama 2) or 500000.0 (Llama 3)"),
        "norm_eps": _above_zero("norm_eps", "try 1e-5"),
        "moe_ffn": ((lambda v: v is None or v >= 1), lambda v: f"moe_ffn={v} must be >= 1, or None (= ffn)"),
        "shared_experts": _at_least(0, "shared_experts", "0: routed experts only"),
        "n_group": _at_least(1, "n_group", "1: no group limit"),
        "topk_group": _at_least(1, "topk_group", "try 1"),
        "routed_scaling_factor": _above_zero("routed_scaling_factor", "1.0 leaves the gates as they are"),
        "dense_layers": _at_least(0, "dense_layers", "0: every block has experts"),
        "bias_update_speed": ((lambda v: v >= 0), lambda v: f"bias_update_speed={v} must be >= 0; try 0.001"),
        "kv_channels": ((lambda v: v is None or v >= 1), lambda v: f"kv_channels={v} must be >= 1, or None"),
        "nope_interval": _at_least(0, "nope_interval", "0 rotates every layer; SmolLM3: 4"),
        "sliding_window": ((lambda v: v is None or v >= 1), lambda v: f"sliding_window={v} must be >= 1, or None"),
        "window_pattern": _at_least(0, "window_pattern", "0 makes every layer local; Gemma 3: 6"),
        "rope_local_theta": ((lambda v: v is None or v > 0), lambda v: f"rope_local_theta={v} must be > 0, or None"),
        "rope_linear_factor": _above_zero("rope_linear_factor", "1.0 leaves RoPE unscaled; Gemma 3: 8.0"),
        "query_pre_attn_scalar": (
            (lambda v: v is None or v > 0),
            lambda v: f"query_pre_attn_scalar={v} must be > 0, or None (= head_dim)",
        ),
    },
    "ParallelConfig": {
        **{d: _at_least(1, d, "try 1") for d in DIMS},
        "order": (_names_every_dim, lambda v: f"order={v!r} {_EVERY_DIM}"),
        "microbatches": _at_least(1, "microbatches", "try 1"),
        "global_batch": _at_least(1, "global_batch", "try 8"),
        "virtual_stages": _at_least(1, "virtual_stages", "try 1"),
        "stage_layers": (
            (lambda v: min(v, default=0) >= 0),
            lambda v: f"stage_layers={v} must hold whole numbers >= 0",
        ),
        "bucket_mb": _above_zero("bucket_mb", "try 25"),
        "cp_a2a": _at_least(1, "cp_a2a", "1, or with cp_kind='hierarchical' a divisor of cp"),
        "dp_replicate": _at_least(1, "dp_replicate", "1 keeps one flat dp dim"),
    },
    "RopeScaling": {  # Llama 3.1's values as the fixes
        "factor": _above_zero("factor", "try 8.0", _ROPE),
        "low_freq_factor": _above_zero("low_freq_factor", "try 1.0", _ROPE),
        "high_freq_factor": _above_zero("high_freq_factor", "try 4.0", _ROPE),
        "original_max_position": _at_least(1, "original_max_position", "try 8192", _ROPE),
    },
}
"""Per config class (by name: this module cannot import the classes) and field: (the range test,
the problem when it fails) of a value whose type is right."""


def field_problems(obj) -> list[str]:
    """Every field of `obj` whose type or range is wrong: what a config refuses when it is built."""
    ranges = _RANGES.get(type(obj).__name__, {})
    out = []
    for name, value, wrong_type in typed_fields(obj):
        if wrong_type:
            out.append(wrong_type)
        elif name in ranges and not ranges[name][0](value):
            out.append(ranges[name][1](value))
    return out


_CHECKS: dict[type, tuple] = {}
_PASSED: set = set()
"""The (class, values, their types) of configs that passed: the theory and the planner build tens of
thousands of configs a search, most of them seen before, and one lookup is a quarter of a check."""


def _fused(fits, in_range):
    return fits if in_range is None else lambda v: fits(v) and in_range(v)


def _names(cls) -> dict[str, int]:
    """Field name -> its position among check_fields' tests."""
    if cls not in _NAMES:
        _NAMES[cls] = {f.name: i for i, (f, _, _) in enumerate(field_tests(cls))}
    return _NAMES[cls]


_NAMES: dict[type, dict[str, int]] = {}


def _checks(cls) -> tuple:
    """(the fields' values in order, the test of each one's type and range, the positions of the
    tuple fields), built once per config class."""
    if cls not in _CHECKS:
        fields = field_tests(cls)
        ranges = _RANGES.get(cls.__name__, {})
        # a field's type test and range test fused into one call: check_fields runs them on every config built
        tests = [_fused(fits, ranges.get(f.name, (None,))[0]) for f, _, fits in fields]
        tuples = [i for i, (_, hint, _) in enumerate(fields) if typing.get_origin(hint) is tuple]
        _CHECKS[cls] = operator.attrgetter(*(f.name for f, _, _ in fields)), tests, tuples
    return _CHECKS[cls]


def check_fields(obj) -> None:
    """Raise ConfigError naming each of `obj`'s wrong fields (the configs' __post_init__)."""
    values_of, tests, tuples = _checks(type(obj))
    replaced = REPLACING.get()
    if replaced is not None and type(replaced[0]) is type(obj):
        REPLACING.set(None)  # this object is the one replace builds; any other config built inside is not
        names = _names(type(obj))
        for k in replaced[1]:
            # the value as __post_init__ left it (a stage_layers list made a tuple), not as passed
            v = getattr(obj, k)
            try:  # a value seen before for this field (a pipeline's stage split: 16 ints to test) passes at once
                key = (type(obj), k, type(v), v)
                if key in _PASSED:
                    continue
            except TypeError:
                key = None
            if not tests[names[k]](v):
                raise ConfigError(field_problems(obj))
            if key is not None:
                _PASSED.add(key)
        return
    values = values_of(obj)
    try:  # types too, and a tuple field's items': 1 == True and (2, 3) == (2.0, 3.0) in a set
        key = (type(obj), values, tuple(map(type, values)), *(tuple(map(type, values[i])) for i in tuples))
        # the same values of the same types passed before: no test runs
        if key in _PASSED:
            return
    except TypeError:  # unhashable, or no tuple where one belongs: the tests name it
        key = None
    for ok, value in zip(tests, values, strict=True):
        # the fast path stops at the first failure; field_problems then names every wrong field
        if not ok(value):
            raise ConfigError(field_problems(obj))
    if key is not None:
        # bounded: a long search must not grow the set without end
        if len(_PASSED) > 100_000:
            _PASSED.clear()
        _PASSED.add(key)
