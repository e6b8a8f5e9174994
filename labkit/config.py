"""Plain-data configuration: what to train and how to lay it out.

This module is the bottom rung of labkit's import ladder: the engines import it, so it
imports nothing but the standard library. Every config round-trips through a plain dict
(`to_dict` / `from_dict`); that dict is what crosses from the notebook to the engines.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DIMS = ("tp", "cp", "ep", "dp", "pp")
"""The mesh dimensions, in the default order (innermost first, Megatron's convention)."""

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
IMPLS = ("lab", "torch")
PRECISIONS = ("fp32", "bf16")


class ConfigError(ValueError):
    """A layout, model or argument that cannot run; the message lists every problem and a fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) with this configuration:\n{lines}")


class _Dict:
    """Round-trip a dataclass through a plain dict (the form that crosses to the engines)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError([f"{cls.__name__} has no field(s) {unknown}; known: {sorted(names)}"])
        return cls(**d)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig(_Dict):
    """A small GPT-style decoder (pre-LN, causal attention, GELU MLP, untied LM head)."""

    layers: int = 4
    """Transformer blocks. pp * virtual_stages must divide it (each pipeline chunk gets the same count)."""
    hidden: int = 64
    """Model width h. heads must divide it."""
    heads: int = 4
    """Attention heads; tp must divide it (tensor parallelism splits attention by heads)."""
    ffn: int = 256
    """MLP inner width (4h, as in GPT-2); tp must divide it."""
    vocab: int = 256
    """Vocabulary size; tp must divide it (vocab-parallel embedding and loss)."""
    seq: int = 64
    """Sequence length s; 2 * cp must divide it (ring attention's zigzag halves)."""
    experts: int = 0
    """Experts per MoE layer; 0 keeps dense MLPs. ep must divide it."""
    top_k: int = 1
    """Experts each token is routed to (1 <= top_k <= experts)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch-Transformer load-balancing loss added to the LM loss (MoE only)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Parameter count Ψ of the full model (every weight, counted once)."""
        h, f, v, s = self.hidden, self.ffn, self.vocab, self.seq
        ln = 2 * h
        attn = 4 * h * h
        if self.experts:
            mlp = h * self.experts + self.experts * 2 * h * f
        else:
            mlp = 2 * h * f
        block = 2 * ln + attn + mlp
        return v * h + s * h + self.layers * block + ln + h * v


@dataclass(frozen=True)
class ParallelConfig(_Dict):
    """One layout of the parallel strategies on the device mesh."""

    dp: int = 1
    """Data-parallel degree: replicas (or shards, with sharding) that see different samples."""
    tp: int = 1
    """Tensor-parallel degree (Megatron): attention heads, MLP width and vocabulary split."""
    pp: int = 1
    """Pipeline-parallel degree: layers split into stages that pass activations."""
    cp: int = 1
    """Context-parallel degree: the sequence split over ranks, attention by a ring (zigzag)."""
    ep: int = 1
    """Expert-parallel degree: ranks that share the experts and split the batch (needs experts > 0)."""
    sharding: str = "none"
    """'none' (DDP), 'zero1', 'zero2', 'zero3' (ZeRO stages) or 'fsdp' (per-block units)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout regions along the sequence inside a TP group (needs tp > 1)."""
    microbatches: int = 1
    """Microbatches per step: pipeline microbatches, or gradient accumulation when pp == 1."""
    schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b' or 'interleaved' (needs virtual_stages > 1)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B)."""
    global_batch: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and microbatches."""
    impl: str = "lab"
    """'lab' runs labkit's readable implementations; 'torch' runs PyTorch's own (DDP, FSDP2, DTensor, pipelining)."""
    precision: str = "fp32"
    """'fp32', or 'bf16': bf16 compute with fp32 master weights and optimizer state."""
    checkpoint_activations: bool = False
    """Recompute each block in backward instead of keeping its activations."""
    order: str = "tp-cp-ep-dp-pp"
    """Mesh order, innermost (fastest-varying rank) first. Neighbouring ranks share the inner dims."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for DDP-style reduction (PyTorch DDP's bucket_cap_mb)."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3 traffic) or keep them (ZeRO-2-like)."""

    @property
    def world(self) -> int:
        """Ranks this layout uses: dp * tp * pp * cp * ep."""
        return self.dp * self.tp * self.pp * self.cp * self.ep

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}


@dataclass(frozen=True)
class OptimConfig(_Dict):
    """AdamW with global-norm gradient clipping; the same numbers in every layout and the reference."""

    lr: float = 3e-3
    """Learning rate (constant: no schedule, so steps compare one to one)."""
    beta1: float = 0.9
    beta2: float = 0.95
    """Adam moments' decay rates (GPT-3's betas)."""
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices (>= 2-D) only, as nanoGPT does."""
    clip: float = 1.0
    """Max global gradient norm (all shards, each parameter counted once); 0 disables clipping."""


@dataclass(frozen=True)
class RunSpec(_Dict):
    """One training run as every engine receives it: Lab.run builds it, engines/train.py
    `run_rank` runs it (the dry run and the torchrun benchmark too). Its `to_dict()` is what
    crosses to the engines: plain data, the three configs nested as their own dicts."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """The layout of the strategies on the mesh."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """What to train: the full model every rank builds from the seed and then slices."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimizer and its clipping, the same as the reference's."""
    steps: int = 3
    """Optimizer steps to train."""
    seed: int = 0
    """Seeds the initial weights and the synthetic batches (the same on every rank and in the reference)."""
    return_params: bool = False
    """Bring back every rank's part of the final parameters (res.params), to check against the reference."""
    audit: bool = False
    """Run a TorchDispatchMode beside the comm meter and count what it sees (slow; tests use it)."""
    comm_log: bool = True
    """Record collectives in the job's log; False only for the overhead benchmark (nothing is recorded)."""

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        """The nested configs come back as dataclasses (to_dict made them dicts)."""
        nested = {"parallel": ParallelConfig, "model": ModelConfig, "optim": OptimConfig}
        return super().from_dict({k: nested[k].from_dict(v) if k in nested else v for k, v in d.items()})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _try(values: list[int]) -> str:
    values = sorted(set(values))
    if not values:
        return ""
    if len(values) == 1:
        return f"try {values[0]}"
    return "try " + ", ".join(str(v) for v in values[:-1]) + f" or {values[-1]}"


_KINDS = {"int": "a whole number (int)", "float": "a finite number", "bool": "True or False", "str": "a string"}


def field_problems(obj) -> list[str]:
    """Fields whose value is not of the type the dataclass declares (checked first: the rest of
    the checks do arithmetic on them). A bool is not taken for an int, nor a NaN for a number."""
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        ok = {"int": isinstance(v, int) and not isinstance(v, bool),
              "float": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
              "bool": isinstance(v, bool),
              "str": isinstance(v, str)}.get(f.type, True)
        if not ok:
            out.append(f"{type(obj).__name__}.{f.name}={v!r} must be {_KINDS[f.type]}; the default is {f.default!r}")
    return out


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
    if any(not isinstance(getattr(model, f), int) or getattr(model, f) < 1
           for f in ("layers", "hidden", "heads", "ffn", "vocab", "seq")):
        return out

    if model.hidden % model.heads:
        out.append(f"hidden={model.hidden} is not divisible by heads={model.heads}; "
                   f"{_try([h for h in _divisors(model.hidden) if h <= 64])} heads")
    if model.heads % cfg.tp:
        out.append(f"heads={model.heads} is not divisible by tp={cfg.tp}; "
                   f"{_try(_divisors(model.heads))} for tp")
    if model.ffn % cfg.tp:
        out.append(f"ffn={model.ffn} is not divisible by tp={cfg.tp}; tp must divide ffn")
    if model.vocab % cfg.tp:
        out.append(f"vocab={model.vocab} is not divisible by tp={cfg.tp} (vocab-parallel embedding); "
                   f"use a vocab that is a multiple of {cfg.tp}")
    chunks = cfg.pp * cfg.virtual_stages
    if cfg.virtual_stages < 1:
        out.append(f"virtual_stages={cfg.virtual_stages} must be >= 1; try 1")
    elif model.layers % chunks:
        fits = [p for p in _divisors(model.layers) if p * cfg.virtual_stages <= model.layers]
        out.append(f"layers={model.layers} cannot be split into pp({cfg.pp}) * virtual_stages("
                   f"{cfg.virtual_stages}) = {chunks} equal chunks; {_try(fits)} for pp")
    if model.seq % (2 * cfg.cp):
        out.append(f"seq={model.seq} is not divisible by 2*cp={2 * cfg.cp} (ring attention's zigzag "
                   f"halves); {_try([c for c in _divisors(model.seq // 2) if c <= 8])} for cp")
    if cfg.ep > 1 and model.experts == 0:
        out.append(f"ep={cfg.ep} needs an MoE model; set experts to a multiple of {cfg.ep} or ep=1")
    if model.experts < 0:
        out.append(f"experts={model.experts} must be >= 0 (0 = dense MLPs)")
    elif model.experts and model.experts % cfg.ep:
        out.append(f"experts={model.experts} is not divisible by ep={cfg.ep}; "
                   f"{_try(_divisors(model.experts))} for ep")
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

    if cfg.schedule == "interleaved" and cfg.virtual_stages < 2:
        out.append("schedule='interleaved' needs virtual_stages >= 2; try virtual_stages=2")
    if cfg.virtual_stages > 1 and cfg.schedule != "interleaved":
        out.append(f"virtual_stages={cfg.virtual_stages} only applies to schedule='interleaved'; "
                   "set schedule='interleaved' or virtual_stages=1")
    if cfg.schedule == "interleaved" and cfg.pp > 1 and cfg.microbatches % cfg.pp:
        out.append(f"interleaved 1F1B needs microbatches ({cfg.microbatches}) to be a multiple of "
                   f"pp ({cfg.pp}), as in Megatron; try microbatches={cfg.pp * max(1, cfg.microbatches // cfg.pp)}")
    if cfg.impl == "torch" and cfg.cp > 1:
        out.append(f"impl='torch' with cp={cfg.cp}: PyTorch's context_parallel needs CUDA flash/efficient "
                   "attention, and labkit does not run it; use impl='lab' (ring attention) or cp=1")
    if cfg.impl == "torch" and cfg.ep > 1:
        out.append(f"impl='torch' with ep={cfg.ep}: PyTorch has no expert-parallel API; "
                   "use impl='lab' (all-to-all dispatch) or ep=1")
    if cfg.impl == "torch" and cfg.pp > 1 and cfg.schedule == "1f1b" and cfg.microbatches < cfg.pp:
        out.append(f"torch's Schedule1F1B needs microbatches ({cfg.microbatches}) >= pp ({cfg.pp}); "
                   f"try microbatches={cfg.pp} or impl='lab'")
    if cfg.sequence_parallel and cfg.tp == 1:
        out.append("sequence_parallel=True needs tp > 1 (it shards along the sequence inside a TP group); "
                   "set tp=2 or sequence_parallel=False")
    if cfg.sequence_parallel and model.seq % (cfg.tp * cfg.cp):
        out.append(f"sequence_parallel needs seq={model.seq} divisible by tp*cp={cfg.tp * cfg.cp}")
    if not cfg.bucket_mb > 0:
        out.append(f"bucket_mb={cfg.bucket_mb} must be > 0; try 25")
    out += _sharding_problems(cfg)
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
        out.append("precision='bf16' with impl='torch' and sharding='none': PyTorch's DDP has no bf16 "
                   "compute with fp32 master weights; use impl='lab', or sharding='fsdp' (FSDP2's "
                   "MixedPrecisionPolicy)")
    if not cfg.reshard_after_forward and cfg.sharding != "fsdp":
        out.append(f"reshard_after_forward=False only applies to sharding='fsdp' (got {cfg.sharding!r}); "
                   "set sharding='fsdp' or reshard_after_forward=True")
    if cfg.sharding in ("zero2", "zero3", "fsdp") and cfg.pp > 1:
        out.append(f"sharding={cfg.sharding!r} with pp={cfg.pp}: a pipeline runs m microbatch backwards per "
                   "step, so sharded gradients would be reduce-scattered after every one (m times ZeRO-1's "
                   "traffic) and ZeRO-3 would gather each stage's parameters again for every microbatch's "
                   "forward and backward; DeepSpeed's pipeline engine refuses ZeRO-2/3 for this reason. "
                   "Use sharding='zero1' (optimizer states sharded, gradients reduced once) with pp")
    if cfg.impl == "torch" and cfg.tp > 1 and cfg.dp > 1 and cfg.sharding != "fsdp":
        out.append(f"impl='torch' with tp={cfg.tp} and dp={cfg.dp}: PyTorch composes DTensor tensor parallelism "
                   "with FSDP2 over dp (torchtitan's 2-D), not with DistributedDataParallel (its DDP + TP path is "
                   "a private transform); use sharding='fsdp', or impl='lab'")
    return out


def not_built_yet(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """Layouts whose strategy is not implemented yet (each line goes when its strategy lands)."""
    out = []
    if cfg.tp > 1 and cfg.impl == "torch" and cfg.pp > 1:
        out.append("impl='torch' with tp > 1 and pp > 1 (DTensor TP inside torch.distributed.pipelining stages) "
                   "is not built yet; use impl='lab'")
    if cfg.tp > 1 and cfg.impl == "torch" and model.experts:
        out.append("impl='torch' with tp > 1 and an MoE model (DTensor plans for the experts) is not built yet; "
                   "use impl='lab' (MoE layers replicated over tp) or experts=0")
    return out


def validate(cfg: ParallelConfig, model: ModelConfig, engines: int | None = None) -> None:
    """Raise ConfigError listing every violated constraint (with a fix), or return None."""
    found = problems(cfg, model, engines)
    found += [p for p in not_built_yet(cfg, model) if p not in found]
    if found:
        raise ConfigError(found)
