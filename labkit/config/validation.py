"""Every check on a config, each problem naming the field, the value and a fix (one ConfigError).

At construction (field_checks.py: `check_fields`, which each config's __post_init__ runs): a field's
type or a choice among its Literal's values, and a range that needs no other field.
Across fields and against the world (`problems`, `validate`): what the layout and
the model must satisfy together (divisibility, the schedule's rules, what runs with what), the
model family's and the stages' own rules asked from model_problems.py, the schedule's and the
cp kind's from strategy_problems.py; `not_built_yet` what only
the theory predicts; `optim_problems` the optimizer, `data_problems` a run's data. Checks on other
things live with them: Lab.run's other arguments (labkit/cluster/arguments.py), what a world's
backend and devices allow (cluster/world.py backend_problems), the planner's arithmetic-only view
of `problems` (theory/planner/evaluate.py layout_problems), a Hugging Face config.json
(config/hf/), generation's arguments (engines/generate.py). The Lab, the theory, the widgets
(which offer only valid values) and the CLI all ask these. Plain Python, the ladder's bottom rung:
the configs' modules import it, so it names the config classes for type hints only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from labkit.config.choices import DATA, ConfigError, trains_on_text, unknown
from labkit.config.field_checks import check_fields, field_problems  # noqa: F401 - the configs import them from here
from labkit.config.field_types import type_problems
from labkit.config.model_problems import divisors, family_problems, stage_problems, suggest
from labkit.config.moe import moe_layout_problems, moe_problems
from labkit.config.strategy_problems import context_problems, float8_not_built, hybrid_problems, schedule_problems

if TYPE_CHECKING:
    from labkit.config import ModelConfig, OptimConfig, ParallelConfig


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
    if not optim.muon_lr > 0:
        out.append(f"muon_lr={optim.muon_lr} must be > 0; try 1e-3")
    if optim.muon_weight_decay < 0:
        out.append(f"muon_weight_decay={optim.muon_weight_decay} must be >= 0; try 0.1")
    if not 0 <= optim.momentum < 1:
        out.append(f"momentum={optim.momentum} must be in [0, 1); try 0.95")
    if not 1 <= optim.ns_steps < 100:  # torch.optim.Muon refuses 100 and more
        out.append(f"ns_steps={optim.ns_steps} must be a whole number in [1, 100); try 5")
    return out


def muon_problems(cfg: ParallelConfig, model: ModelConfig, optim: OptimConfig) -> list[str]:
    """What of a layout Muon does not run on yet, each with the nearest that it does. Muon's update needs
    each weight matrix whole (Newton-Schulz orthogonalizes the full matrix): DDP holds it (a tp rank
    gathers its slice's update), a pipeline stage and an expert's rank hold theirs; ZeRO and FSDP hold a
    flat shard of it and gather their slices' updates first (Distributed Muon, Liu et al. 2025, section
    2.2: engines/muon.py ShardedMuon), which labkit builds where each local tensor is whole (no tp slice)."""
    if not optim.kind.muon:
        return []
    out = []
    if cfg.sharded.optimizer and cfg.tp > 1 and not cfg.torch_impl:
        out.append(
            f"optim name='muon' with sharding={cfg.sharding!r} and tp={cfg.tp} is not built yet: Distributed Muon's "
            "gather of a tp slice's shards is not; use tp=1 with the sharding, or sharding='none' with tp (a tp rank "
            "gathers its slice's update from its tp group)"
        )
    if cfg.sharded.optimizer and cfg.torch_impl:
        out.append(
            f"optim name='muon' with sharding={cfg.sharding!r} and impl='torch' is not built yet: FSDP2 with "
            "torch.optim.Muon is not (it takes plain tensors, not FSDP2's DTensor shards); use impl='lab', whose "
            "ZeRO and FSDP gather each matrix's update whole (Distributed Muon)"
        )
    if cfg.torch_impl and (cfg.tp > 1 or cfg.pp > 1):
        out.append(
            "optim name='muon' with impl='torch' and tp or pp > 1 is not built: torch.optim.Muon takes plain 2-D "
            "parameters; use impl='lab', or impl='torch' on dp alone (PyTorch's DDP with torch.optim.Muon)"
        )
    if cfg.torch_impl and model.experts:
        out.append(
            "optim name='muon' with impl='torch' on an MoE model: torch.optim.Muon refuses the experts' stacked "
            "3-D weights; use impl='lab', which orthogonalizes each expert's matrix on its own"
        )
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
