"""Plain-data configuration: what to train and how to lay it out.

This module is the bottom rung of labkit's import ladder: the engines import it, so it
imports nothing but the standard library. Every config round-trips through a plain dict
(`to_dict` / `from_dict`); that dict is what crosses from the notebook to the engines.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DIMS = ("tp", "cp", "ep", "dp", "pp")
"""The mesh dimensions, in the default order (innermost first, Megatron's convention)."""

SHARDINGS = ("none", "zero1", "zero2", "zero3", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
IMPLS = ("lab", "torch")
PRECISIONS = ("fp32", "bf16", "fp8")
CHECKPOINTING = (False, True, "full", "selective", "op")
"""checkpoint_activations values: off; full recomputation (True is "full"); Korthikanti et al.'s
selective (the attention core); torchtitan's per-op selective policy ("op": the theory only)."""
DATA = ("synthetic", "text")
"""What a run trains on: the synthetic language (engines/data.py) or the Shakespeare corpus in bytes
(labkit/plans/text.py; needs vocab >= 256)."""


def recompute_mode(checkpoint_activations: bool | str) -> str:
    """'none', 'full', 'selective' or 'op' for a checkpoint_activations value (True is 'full')."""
    if isinstance(checkpoint_activations, bool):
        return "full" if checkpoint_activations else "none"
    return checkpoint_activations


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
    """Vocabulary size; tp must divide it (vocab-parallel embedding and loss); data="text" needs >= 256 (bytes)."""
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
    """'fp32'; 'bf16': bf16 compute with fp32 master weights and optimizer state; 'fp8': as bf16,
    with the linear layers' matmuls in fp8 (per-tensor scales, torchao's float8 training) and
    FSDP's all-gather in fp8 (the theory only: the engines refuse it, validation says why)."""
    checkpoint_activations: bool | str = False
    """Recompute in backward instead of keeping: False; True or 'full' (each block keeps its input
    only, Chen et al. 2016); 'selective' (the attention core only, Korthikanti et al. 2022, section
    4.2); 'op' (torchtitan's per-op policy: every matmul's output but every second, and the
    attention's, kept; the theory only)."""
    order: str = "tp-cp-ep-dp-pp"
    """Mesh order, innermost (fastest-varying rank) first. Neighbouring ranks share the inner dims."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB for DDP-style reduction (PyTorch DDP's bucket_cap_mb)."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3 traffic) or keep them (ZeRO-2-like)."""

    @property
    def recompute(self) -> str:
        """'none', 'full', 'selective' or 'op': checkpoint_activations by name (True is 'full')."""
        return recompute_mode(self.checkpoint_activations)

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
    """Seeds the initial weights and the batches (the same on every rank and in the reference)."""
    data: str = "synthetic"
    """'synthetic' (the synthetic language) or 'text' (the corpus; the ranks also compute the validation loss)."""
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
