"""Every check on a config, each problem naming the field, the value and a fix (one ConfigError).

At construction (`field_problems`, which each config's __post_init__ runs): a field's type or a
choice among its Literal's values (field_types.py reads the annotations), and a range that needs
no other field. Across fields and against the world (`problems`, `validate`): what the layout and
the model must satisfy together (divisibility, the schedule's rules, what runs with what), the
model family's and the stages' own rules asked from model_problems.py, the schedule's and the
cp kind's from strategy_problems.py; `not_built_yet` what only
the theory predicts; `optim_problems` the optimizer, `data_problems` a run's data. Checks on other
things live with them: Lab.run's other arguments (labkit/cluster/arguments.py), what a world's
backend and devices allow (cluster/world.py backend_problems), the planner's arithmetic-only view
of `problems` (theory/planner/evaluate.py layout_problems), a Hugging Face config.json
(config/hf.py), generation's arguments (engines/generate.py). The Lab, the theory, the widgets
(which offer only valid values) and the CLI all ask these. Plain Python, the ladder's bottom rung:
the configs' modules import it, so it names the config classes for type hints only.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from typing import TYPE_CHECKING

from labkit.config.base import REPLACING
from labkit.config.choices import DATA, DIMS, ConfigError, trains_on_text, unknown
from labkit.config.field_types import field_tests, type_problems, typed_fields
from labkit.config.model_problems import divisors, family_problems, stage_problems, suggest
from labkit.config.moe import moe_layout_problems, moe_problems
from labkit.config.strategy_problems import context_problems, float8_not_built, hybrid_problems, schedule_problems

if TYPE_CHECKING:
    from labkit.config import ModelConfig, OptimConfig, ParallelConfig


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


def argument_problems(call: str, cfg, model) -> list[str]:
    """The problem of a (cfg, model) that is not a ParallelConfig and a ModelConfig (the caller
    checked): the two swapped, or something else."""
    got = (type(cfg).__name__, type(model).__name__)
    # the common slip, said as such rather than as two wrong types
    if got == ("ModelConfig", "ParallelConfig"):
        return [
            f"{call}(cfg, model) takes the ParallelConfig first and the ModelConfig second, and was given "
            f"them swapped; call {call}(cfg, model)"
        ]
    return [
        f"{call}(cfg, model) takes a ParallelConfig and a ModelConfig, not a {got[0]} and a {got[1]}; "
        f"e.g. {call}(ParallelConfig(dp=2), ModelConfig())"
    ]


# -- a run's data and the optimizer --------------------------------------------------------------
def data_problems(data, model) -> list[str]:
    """What is wrong with a run's `data` for `model` (a model that is not a ModelConfig is someone
    else's problem to report)."""
    if data not in DATA:
        return [unknown("data", data, DATA)]
    vocab = getattr(model, "vocab", None)
    if trains_on_text(data) and isinstance(vocab, int) and vocab < 256:  # one id per byte value
        return [
            f"data='text' reads bytes (ids 0-255) but ModelConfig.vocab={model.vocab}; "
            f"use vocab >= 256, e.g. ModelConfig(..., vocab=256)"
        ]
    return []


def optim_problems(optim: OptimConfig) -> list[str]:
    """What is wrong with an OptimConfig, each with a fix."""
    out = type_problems(optim)
    if out:
        return out
    if not optim.lr > 0:
        out.append(f"lr={optim.lr} must be > 0; try 3e-3")
    defaults = {f.name: f.default for f in dataclasses.fields(optim)}
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(optim, name) < 1:
            out.append(f"{name}={getattr(optim, name)} must be in [0, 1); try {defaults[name]}")
    if not optim.eps > 0:
        out.append(f"eps={optim.eps} must be > 0; try 1e-8")
    if optim.weight_decay < 0:
        out.append(f"weight_decay={optim.weight_decay} must be >= 0; try 0.1")
    if optim.clip < 0:
        out.append(f"clip={optim.clip} must be >= 0 (0 disables clipping); try 1.0")
    return out


# -- across fields: the layout, the model and the world ------------------------------------------
def problems(cfg: ParallelConfig, model: ModelConfig, engines: int | None = None) -> list[str]:
    """Every constraint that (cfg, model) violates together on `engines` ranks, each with a fix
    (each field alone was checked when its config was built)."""
    out: list[str] = []
    if model.layers == 0:  # a model of its ends alone is the theory's (a chunk's head and embedding)
        return ["model layers=0 must be a positive integer: a model to lay out has a block; try layers=4"]
    if engines is not None and cfg.world > engines:
        out.append(
            f"dp({cfg.dp}) * tp({cfg.tp}) * pp({cfg.pp}) * cp({cfg.cp}) * ep({cfg.ep}) = {cfg.world} "
            f"> engines({engines}); lower a degree or start a Lab with {cfg.world} engines"
        )
    if model.hidden % model.heads:
        out.append(
            f"hidden={model.hidden} is not divisible by heads={model.heads}; "
            f"{suggest([h for h in divisors(model.hidden) if h <= 64])} heads"
        )
    if model.heads % cfg.tp:
        out.append(f"heads={model.heads} is not divisible by tp={cfg.tp}; {suggest(divisors(model.heads))} for tp")
    if model.ffn % cfg.tp:
        out.append(f"ffn={model.ffn} is not divisible by tp={cfg.tp}; tp must divide ffn")
    # padded (vocab_divisible_by), the rows split evenly whatever the vocab
    if model.vocab % cfg.tp and model.vocab_divisible_by is None:
        out.append(
            f"vocab={model.vocab} is not divisible by tp={cfg.tp} (vocab-parallel embedding); set "
            f"ModelConfig.vocab_divisible_by=128 to pad the embedding and the head to "
            f"{model.replace(vocab_divisible_by=128).padded_vocab(cfg.tp)} rows as Megatron does (the padding "
            f"masked out of the loss: the same model), or use a vocab that is a multiple of {cfg.tp}"
        )
    out += family_problems(cfg, model)
    out += stage_problems(cfg, model)
    if model.seq % (2 * cfg.cp):
        out.append(
            f"seq={model.seq} is not divisible by 2*cp={2 * cfg.cp} (ring attention's zigzag "
            f"halves); {suggest([c for c in divisors(model.seq // 2) if c <= 8])} for cp"
        )
    out += context_problems(cfg, model)
    if cfg.ep > 1 and model.experts == 0:
        out.append(f"ep={cfg.ep} needs an MoE model; set experts to a multiple of {cfg.ep} or ep=1")
    elif model.experts and model.experts % cfg.ep:
        out.append(
            f"experts={model.experts} is not divisible by ep={cfg.ep}; {suggest(divisors(model.experts))} for ep"
        )
    if model.experts > 0 and not 1 <= model.top_k <= model.experts:
        out.append(f"top_k={model.top_k} must be between 1 and experts={model.experts}")
    out += moe_problems(model) + moe_layout_problems(cfg, model)  # labkit/config/moe.py

    # the engines split the global batch over dp x ep, then into microbatches (theory/exact/batch.py)
    split = cfg.dp * cfg.ep * cfg.microbatches
    if cfg.global_batch % split:
        out.append(
            f"global_batch={cfg.global_batch} is not divisible by dp({cfg.dp}) * ep({cfg.ep}) * "
            f"microbatches({cfg.microbatches}) = {split}; try global_batch="
            f"{split * max(1, -(-cfg.global_batch // split))}"
        )

    out += schedule_problems(cfg)
    if cfg.torch_impl and cfg.cp > 1:
        out.append(
            f"impl='torch' with cp={cfg.cp}: PyTorch's context_parallel needs CUDA flash/efficient "
            "attention, and labkit does not run it; use impl='lab' (ring attention) or cp=1"
        )
    if cfg.torch_impl and cfg.ep > 1:
        out.append(
            f"impl='torch' with ep={cfg.ep}: PyTorch has no expert-parallel API; "
            "use impl='lab' (all-to-all dispatch) or ep=1"
        )
    if cfg.torch_impl and cfg.pp > 1 and cfg.pipeline.one_f_one_b and cfg.microbatches < cfg.pp:
        out.append(
            f"torch's Schedule1F1B needs microbatches ({cfg.microbatches}) >= pp ({cfg.pp}); "
            f"try microbatches={cfg.pp} or impl='lab'"
        )
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append(
            "sequence_parallel=True needs tp > 1 (it shards along the sequence inside a TP group); "
            "set tp=2 or sequence_parallel=False"
        )
    # SP splits a cp rank's s/cp positions over tp
    if cfg.sequence_parallel and model.seq % (cfg.tp * cfg.cp):
        out.append(f"sequence_parallel needs seq={model.seq} divisible by tp*cp={cfg.tp * cfg.cp}")
    out += _sharding_problems(cfg)
    out += hybrid_problems(cfg)
    return out


_TORCH_ZERO = {
    1: "PyTorch has no ZeRO-1 for a module (ZeroRedundancyOptimizer shards only the optimizer "
    "and is not wired into labkit); use impl='lab'",
    2: "PyTorch has no ZeRO-2 (sharded gradients with replicated parameters); use impl='lab', or "
    "sharding='fsdp' with reshard_after_forward=False for FSDP2's ZeRO-2-like traffic",
    3: "PyTorch's ZeRO-3 is FSDP2; use sharding='fsdp' (reshard_after_forward=True) with impl='torch'",
}


def _sharding_problems(cfg: ParallelConfig) -> list[str]:
    """Combinations of sharding, impl and precision that have no implementation to run."""
    out = []
    if cfg.torch_impl and cfg.sharded.stage and not cfg.sharded.fsdp:
        out.append(f"sharding={cfg.sharding!r} with impl='torch': {_TORCH_ZERO[cfg.sharded.stage]}")
    if cfg.torch_impl and cfg.sharded.stage == 0 and cfg.numerics.mixed and not cfg.numerics.fp8:
        out.append(
            "precision='bf16' with impl='torch' and sharding='none': PyTorch's DDP has no bf16 "
            "compute with fp32 master weights; use impl='lab', or sharding='fsdp' (FSDP2's "
            "MixedPrecisionPolicy)"
        )
    if not cfg.reshard_after_forward and not cfg.sharded.fsdp:
        out.append(
            f"reshard_after_forward=False only applies to sharding='fsdp' (got {cfg.sharding!r}); "
            "set sharding='fsdp' or reshard_after_forward=True"
        )
    if cfg.torch_impl and cfg.tp > 1 and cfg.dp > 1 and not cfg.sharded.fsdp:
        out.append(
            f"impl='torch' with tp={cfg.tp} and dp={cfg.dp}: PyTorch composes DTensor tensor parallelism "
            "with FSDP2 over dp (torchtitan's 2-D), not with DistributedDataParallel (its DDP + TP path is "
            "a private transform); use sharding='fsdp', or impl='lab'"
        )
    return out


def not_built_yet(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """Layouts the engines do not run (each goes when its strategy lands); the theory predicts them all."""
    out = float8_not_built(cfg, model)
    if cfg.recomputation.per_op:
        out.append(
            "checkpoint_activations='op' (torchtitan's per-op selective policy) is predicted by the "
            "theory but not run by the engines; use 'selective' (the attention core) or 'full'"
        )
    for on, what in ((cfg.tp > 1, "tp > 1 (DTensor TP"), (cfg.sharded.fsdp, "sharding='fsdp' (FSDP2")):
        if on and cfg.torch_impl and cfg.pp > 1:
            out.append(
                f"impl='torch' with pp > 1 and {what} on torch.distributed.pipelining stages) is not built "
                "yet; use impl='lab'"
            )
    if cfg.tp > 1 and cfg.torch_impl and model.padded_vocab(cfg.tp) != model.vocab:
        out.append(
            f"impl='torch' with tp > 1 and vocab_divisible_by={model.vocab_divisible_by}: DTensor's loss_parallel "
            "has no mask for the padding logits; use impl='lab' (its vocab-parallel loss masks them)"
        )
    if cfg.tp > 1 and cfg.torch_impl and model.experts:
        out.append(
            "impl='torch' with tp > 1 and an MoE model (DTensor styles for the experts) is not built yet; "
            "use impl='lab' (MoE layers replicated over tp) or experts=0"
        )
    split = cfg.pp > 1 and cfg.pipeline.splits_backward
    if split and cfg.torch_impl and cfg.dp > 1:
        out.append(
            f"impl='torch' with schedule={cfg.schedule!r} and dp > 1: torch.distributed.pipelining's weight "
            "backward writes .grad itself, so PyTorch's DDP never sees those gradients (measured: replicas "
            "drift apart); use impl='lab', or impl='torch' with dp=1"
        )
    if split and cfg.recomputation.recomputes:
        out.append(
            f"schedule={cfg.schedule!r} with checkpoint_activations is not built yet: the recomputed block "
            "computes its weight gradients with its input gradient, so W has nothing to defer; use '1f1b'"
        )
    if cfg.pp > 1 and cfg.pipeline.v_shaped and model.tied:
        out.append(
            f"schedule={cfg.schedule!r} with a tied embedding: the V puts the first and the last stage on "
            "rank 0, one weight in two chunks, which the gradient buckets (per chunk) do not handle yet; "
            "use tie_embeddings=False, or schedule='zbh1'"
        )
    return out


def validate(cfg: ParallelConfig, model: ModelConfig, engines: int | None = None) -> None:
    """Raise ConfigError listing every violated constraint (with a fix), or return None."""
    found = problems(cfg, model, engines)
    # a problem both lists name is said once
    found += [p for p in not_built_yet(cfg, model) if p not in found]
    if found:
        raise ConfigError(found)
