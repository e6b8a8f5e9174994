"""Validation: every constraint a layout, a model or an optimizer config violates, each with a fix.

`validate` raises one ConfigError naming every problem before any engine work; the Lab, the theory,
the widgets (which offer only valid values) and the CLI all ask the same functions. Plain Python:
the bottom rung of the ladder with labkit/config/__init__.py (ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import math

from labkit.config import (
    CHECKPOINTING,
    DATA,
    DIMS,
    IMPLS,
    PRECISIONS,
    SCHEDULES,
    SHARDINGS,
    ConfigError,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
)
from labkit.config.model_problems import divisors, family_problems, stage_problems, suggest

_KINDS = {"int": "a whole number (int)", "float": "a finite number", "bool": "True or False", "str": "a string"}


def field_problems(obj) -> list[str]:
    """Fields whose value is not of the type the dataclass declares (checked first: the rest of
    the checks do arithmetic on them). A bool is not taken for an int, nor a NaN for a number."""
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        ok = {
            "int": isinstance(v, int) and not isinstance(v, bool),
            "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "bool": isinstance(v, bool),
            "str": isinstance(v, str),
        }.get(f.type, True)
        if not ok:
            out.append(f"{type(obj).__name__}.{f.name}={v!r} must be {_KINDS[f.type]}; the default is {f.default!r}")
    return out


def data_problems(data, model) -> list[str]:
    """What is wrong with a run's `data` for `model` (a model that is not a ModelConfig is someone
    else's problem to report)."""
    if data not in DATA:
        return [f"data={data!r} is not one of {list(DATA)}; try 'text' (Shakespeare, in bytes) or 'synthetic'"]
    vocab = getattr(model, "vocab", None)
    if data == "text" and isinstance(vocab, int) and vocab < 256:  # one id per byte value
        return [
            f"data='text' reads bytes (ids 0-255) but ModelConfig.vocab={model.vocab}; "
            f"use vocab >= 256, e.g. ModelConfig(..., vocab=256)"
        ]
    return []


def optim_problems(optim: OptimConfig) -> list[str]:
    """What is wrong with an OptimConfig, each with a fix."""
    out = field_problems(optim)
    if out:
        return out
    if not optim.lr > 0:
        out.append(f"lr={optim.lr} must be > 0; try 3e-3")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(optim, name) < 1:
            out.append(f"{name}={getattr(optim, name)} must be in [0, 1); try {getattr(OptimConfig, name)}")
    if not optim.eps > 0:
        out.append(f"eps={optim.eps} must be > 0; try 1e-8")
    if optim.weight_decay < 0:
        out.append(f"weight_decay={optim.weight_decay} must be >= 0; try 0.1")
    if optim.clip < 0:
        out.append(f"clip={optim.clip} must be >= 0 (0 disables clipping); try 1.0")
    return out


def problems(cfg: ParallelConfig, model: ModelConfig, engines: int | None = None) -> list[str]:
    """Every constraint that (cfg, model) violates on `engines` ranks, each with a fix."""
    out: list[str] = field_problems(cfg) + field_problems(model)
    if out:
        return out  # the rest is arithmetic on the fields
    for d in DIMS:
        v = getattr(cfg, d)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            out.append(f"{d}={v!r} must be a positive integer; try 1")
    if out:
        return out  # the rest is arithmetic on the degrees

    def choice(name: str, value, allowed):
        if value not in allowed:
            out.append(f"{name}={value!r} is not one of {list(allowed)}; pick one of those")

    choice("sharding", cfg.sharding, SHARDINGS)
    choice("schedule", cfg.schedule, SCHEDULES)
    choice("impl", cfg.impl, IMPLS)
    choice("precision", cfg.precision, PRECISIONS)
    ac = cfg.checkpoint_activations
    if not isinstance(ac, bool) and ac not in CHECKPOINTING[2:]:
        out.append(
            f"checkpoint_activations={cfg.checkpoint_activations!r} is not one of {list(CHECKPOINTING)}; "
            "pick one of those (True is 'full')"
        )

    if engines is not None and cfg.world > engines:
        out.append(
            f"dp({cfg.dp}) * tp({cfg.tp}) * pp({cfg.pp}) * cp({cfg.cp}) * ep({cfg.ep}) = {cfg.world} "
            f"> engines({engines}); lower a degree or start a Lab with {cfg.world} engines"
        )
    order = cfg.order.split("-")
    if sorted(order) != sorted(DIMS):
        out.append(
            f"order={cfg.order!r} must name each of {'-'.join(DIMS)} exactly once, innermost first; "
            f"try {'-'.join(DIMS)!r}"
        )

    for field_name in ("layers", "hidden", "heads", "ffn", "vocab", "seq"):
        v = getattr(model, field_name)
        if not isinstance(v, int) or v < 1:
            out.append(f"model {field_name}={v!r} must be a positive integer")
    if any(
        not isinstance(getattr(model, f), int) or getattr(model, f) < 1
        for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq")
    ):
        return out

    if model.hidden % model.heads:
        out.append(
            f"hidden={model.hidden} is not divisible by heads={model.heads}; "
            f"{suggest([h for h in divisors(model.hidden) if h <= 64])} heads"
        )
    if model.heads % cfg.tp:
        out.append(f"heads={model.heads} is not divisible by tp={cfg.tp}; {suggest(divisors(model.heads))} for tp")
    if model.ffn % cfg.tp:
        out.append(f"ffn={model.ffn} is not divisible by tp={cfg.tp}; tp must divide ffn")
    if model.vocab % cfg.tp:
        out.append(
            f"vocab={model.vocab} is not divisible by tp={cfg.tp} (vocab-parallel embedding); "
            f"use a vocab that is a multiple of {cfg.tp}"
        )
    out += family_problems(cfg, model)
    out += stage_problems(cfg, model)
    if model.seq % (2 * cfg.cp):
        out.append(
            f"seq={model.seq} is not divisible by 2*cp={2 * cfg.cp} (ring attention's zigzag "
            f"halves); {suggest([c for c in divisors(model.seq // 2) if c <= 8])} for cp"
        )
    if cfg.ep > 1 and model.experts == 0:
        out.append(f"ep={cfg.ep} needs an MoE model; set experts to a multiple of {cfg.ep} or ep=1")
    if model.experts < 0:
        out.append(f"experts={model.experts} must be >= 0 (0 = dense MLPs)")
    elif model.experts and model.experts % cfg.ep:
        out.append(
            f"experts={model.experts} is not divisible by ep={cfg.ep}; {suggest(divisors(model.experts))} for ep"
        )
    if model.experts > 0 and not 1 <= model.top_k <= model.experts:
        out.append(f"top_k={model.top_k} must be between 1 and experts={model.experts}")
    if model.aux_loss_coef < 0:
        out.append(f"aux_loss_coef={model.aux_loss_coef} must be >= 0; try 0.01")

    if not isinstance(cfg.microbatches, int) or cfg.microbatches < 1:
        out.append(f"microbatches={cfg.microbatches!r} must be a positive integer; try 1")
    elif not isinstance(cfg.global_batch, int) or cfg.global_batch < 1:
        out.append(f"global_batch={cfg.global_batch!r} must be a positive integer")
    else:
        split = cfg.dp * cfg.ep * cfg.microbatches
        if cfg.global_batch % split:
            out.append(
                f"global_batch={cfg.global_batch} is not divisible by dp({cfg.dp}) * ep({cfg.ep}) * "
                f"microbatches({cfg.microbatches}) = {split}; try global_batch="
                f"{split * max(1, -(-cfg.global_batch // split))}"
            )

    out += schedule_problems(cfg)
    if cfg.impl == "torch" and cfg.cp > 1:
        out.append(
            f"impl='torch' with cp={cfg.cp}: PyTorch's context_parallel needs CUDA flash/efficient "
            "attention, and labkit does not run it; use impl='lab' (ring attention) or cp=1"
        )
    if cfg.impl == "torch" and cfg.ep > 1:
        out.append(
            f"impl='torch' with ep={cfg.ep}: PyTorch has no expert-parallel API; "
            "use impl='lab' (all-to-all dispatch) or ep=1"
        )
    if cfg.impl == "torch" and cfg.pp > 1 and cfg.schedule == "1f1b" and cfg.microbatches < cfg.pp:
        out.append(
            f"torch's Schedule1F1B needs microbatches ({cfg.microbatches}) >= pp ({cfg.pp}); "
            f"try microbatches={cfg.pp} or impl='lab'"
        )
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append(
            "sequence_parallel=True needs tp > 1 (it shards along the sequence inside a TP group); "
            "set tp=2 or sequence_parallel=False"
        )
    if cfg.sequence_parallel and model.seq % (cfg.tp * cfg.cp):
        out.append(f"sequence_parallel needs seq={model.seq} divisible by tp*cp={cfg.tp * cfg.cp}")
    if not cfg.bucket_mb > 0:
        out.append(f"bucket_mb={cfg.bucket_mb} must be > 0; try 25")
    out += _sharding_problems(cfg)
    return out


def schedule_problems(cfg: ParallelConfig) -> list[str]:
    """How the schedule, the chunks per rank and the microbatches fit together."""
    out, m, pp = [], cfg.microbatches, cfg.pp
    if cfg.schedule == "interleaved" and cfg.virtual_stages < 2:
        out.append("schedule='interleaved' needs virtual_stages >= 2; try virtual_stages=2")
    if cfg.schedule in ("zbv", "dualpipev") and cfg.virtual_stages != 2:
        out.append(f"schedule={cfg.schedule!r} places two chunks per rank in a V; set virtual_stages=2")
    if cfg.virtual_stages > 1 and cfg.schedule not in ("interleaved", "zbv", "dualpipev"):
        out.append(
            f"virtual_stages={cfg.virtual_stages} only applies to schedule='interleaved' (or 2 to 'zbv', "
            "'dualpipev'); set schedule='interleaved' or virtual_stages=1"
        )
    if cfg.schedule == "interleaved" and pp > 1 and m % pp:
        out.append(
            f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({pp}), as in Megatron; "
            f"try microbatches={pp * max(1, m // pp)}"
        )
    if cfg.schedule == "dualpipev" and pp > 1 and m < 2 * pp:
        out.append(
            f"schedule='dualpipev' needs microbatches ({m}) >= 2 * pp, one per stage of the V, as "
            f"DeepSeek's DualPipeV does; try microbatches={2 * pp}"
        )
    return out


# What PyTorch offers for each sharding (impl='torch'), or why nothing: the reason in the refusal.
_TORCH_SHARDING = {
    "zero1": "PyTorch has no ZeRO-1 for a module (ZeroRedundancyOptimizer shards only the optimizer "
    "and is not wired into labkit); use impl='lab'",
    "zero2": "PyTorch has no ZeRO-2 (sharded gradients with replicated parameters); use impl='lab', or "
    "sharding='fsdp' with reshard_after_forward=False for FSDP2's ZeRO-2-like traffic",
    "zero3": "PyTorch's ZeRO-3 is FSDP2; use sharding='fsdp' (reshard_after_forward=True) with impl='torch'",
}


def _sharding_problems(cfg: ParallelConfig) -> list[str]:
    """Combinations of sharding, impl and precision that have no implementation to run."""
    out = []
    if cfg.impl == "torch" and cfg.sharding in _TORCH_SHARDING:
        out.append(f"sharding={cfg.sharding!r} with impl='torch': {_TORCH_SHARDING[cfg.sharding]}")
    if cfg.impl == "torch" and cfg.sharding == "none" and cfg.precision == "bf16":
        out.append(
            "precision='bf16' with impl='torch' and sharding='none': PyTorch's DDP has no bf16 "
            "compute with fp32 master weights; use impl='lab', or sharding='fsdp' (FSDP2's "
            "MixedPrecisionPolicy)"
        )
    if not cfg.reshard_after_forward and cfg.sharding != "fsdp":
        out.append(
            f"reshard_after_forward=False only applies to sharding='fsdp' (got {cfg.sharding!r}); "
            "set sharding='fsdp' or reshard_after_forward=True"
        )
    if cfg.impl == "torch" and cfg.tp > 1 and cfg.dp > 1 and cfg.sharding != "fsdp":
        out.append(
            f"impl='torch' with tp={cfg.tp} and dp={cfg.dp}: PyTorch composes DTensor tensor parallelism "
            "with FSDP2 over dp (torchtitan's 2-D), not with DistributedDataParallel (its DDP + TP path is "
            "a private transform); use sharding='fsdp', or impl='lab'"
        )
    return out


def not_built_yet(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """Layouts the engines do not run (each goes when its strategy lands); the theory predicts them all."""
    out = []
    if cfg.precision == "fp8":
        out.append(
            "precision='fp8' is predicted by the theory but not run by the engines: fp8 matmuls need "
            "an H100-class GPU (torch._scaled_mm, compute capability >= 8.9), and an emulation on the "
            "CPU (quantize, dequantize, bf16 matmul) would measure bf16's memory and time, not fp8's; "
            "use precision='bf16' on the engines, theory.evaluate(...) for fp8"
        )
    if cfg.checkpoint_activations == "op":
        out.append(
            "checkpoint_activations='op' (torchtitan's per-op selective policy) is predicted by the "
            "theory but not run by the engines; use 'selective' (the attention core) or 'full'"
        )
    for on, what in ((cfg.tp > 1, "tp > 1 (DTensor TP"), (cfg.sharding == "fsdp", "sharding='fsdp' (FSDP2")):
        if on and cfg.impl == "torch" and cfg.pp > 1:
            out.append(
                f"impl='torch' with pp > 1 and {what} on torch.distributed.pipelining stages) is not built "
                "yet; use impl='lab'"
            )
    if cfg.tp > 1 and cfg.impl == "torch" and model.experts:
        out.append(
            "impl='torch' with tp > 1 and an MoE model (DTensor plans for the experts) is not built yet; "
            "use impl='lab' (MoE layers replicated over tp) or experts=0"
        )
    split = cfg.schedule in ("zbh1", "zbv", "dualpipev")
    if cfg.pp > 1 and split and cfg.impl == "torch" and cfg.dp > 1:
        out.append(
            f"impl='torch' with schedule={cfg.schedule!r} and dp > 1: torch.distributed.pipelining's weight "
            "backward writes .grad itself, so PyTorch's DDP never sees those gradients (measured: replicas "
            "drift apart); use impl='lab', or impl='torch' with dp=1"
        )
    if cfg.pp > 1 and split and cfg.checkpoint_activations:
        out.append(
            f"schedule={cfg.schedule!r} with checkpoint_activations is not built yet: the recomputed block "
            "computes its weight gradients with its input gradient, so W has nothing to defer; use '1f1b'"
        )
    if cfg.pp > 1 and cfg.schedule in ("zbv", "dualpipev") and model.tied:
        out.append(
            f"schedule={cfg.schedule!r} with a tied embedding: the V puts the first and the last stage on "
            "rank 0, one weight in two chunks, which the gradient buckets (per chunk) do not handle yet; "
            "use tie_embeddings=False, or schedule='zbh1'"
        )
    return out


def validate(cfg: ParallelConfig, model: ModelConfig, engines: int | None = None) -> None:
    """Raise ConfigError listing every violated constraint (with a fix), or return None."""
    found = problems(cfg, model, engines)
    found += [p for p in not_built_yet(cfg, model) if p not in found]
    if found:
        raise ConfigError(found)
