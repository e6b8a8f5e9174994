"""Plain-data configuration: what to train and how to lay it out.

This module is the bottom rung of labkit's import ladder: the engines import it, so it
imports nothing but the standard library. Every config round-trips through a plain dict
(`to_dict` / `from_dict`); that dict is what crosses from the notebook to the engines. A choice
field is a `Literal` whose names are decoded once (choices.py) into the properties the code reads
(`cfg.sharded`, `cfg.pipeline`, `model.family`, ...: derived, never in the dict); every field is
checked when a config is built (validation.py), so a config that exists has fields of the right
type and range.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import choices
from labkit.config.choices import (
    ARCHS,
    CHECKPOINTING,
    CONTEXT_KINDS,
    DATA,
    DIMS,
    IMPLS,
    LOSSES,
    PRECISIONS,
    SCHEDULES,
    SHARDINGS,
    Arch,
    Checkpointing,
    ConfigError,
    ContextComm,
    ContextKind,
    Data,
    Family,
    Impl,
    Loss,
    Numerics,
    PipelineShape,
    Precision,
    Recomputation,
    Recompute,
    Schedule,
    Sharded,
    Sharding,
)
from labkit.config.hf import hf_fields
from labkit.config.validation import check_fields

__all__ = [
    "ARCHS",
    "CHECKPOINTING",
    "CONTEXT_KINDS",
    "DATA",
    "DIMS",
    "IMPLS",
    "LOSSES",
    "PRECISIONS",
    "SCHEDULES",
    "SHARDINGS",
    "ConfigError",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RopeScaling",
    "RunSpec",
]


class _Dict:
    """Round-trip a dataclass through a plain dict (the form that crosses to the engines)."""

    def to_dict(self) -> dict:
        """Field -> value, nested configs as dicts. Optional fields left unset (None, or an empty
        stage_layers) stay out, so a default config is a dict of plain scalars; from_dict puts
        their defaults back: the round trip is exact."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or v == ():
                continue
            out[f.name] = v.to_dict() if isinstance(v, _Dict) else v
        return out

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
class RopeScaling(_Dict):
    """Llama 3.1's frequency-dependent RoPE scaling (Hugging Face rope_type 'llama3', Meta's
    `apply_scaling` in llama-models): wavelengths longer than original_max_position / low_freq_factor
    are slowed by `factor`, shorter than original_max_position / high_freq_factor kept, and the band
    between interpolated smoothly (engines/layers.py `rope_frequencies`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    """The pre-training context the frequencies were tuned for (HF original_max_position_embeddings)."""

    def __post_init__(self):
        check_fields(self)


@dataclass(frozen=True)
class ModelConfig(_Dict):
    """A decoder-only transformer of one of three families (`arch`), pre-norm, causal.

    Fields whose default depends on the family are None by default and stay None in the config
    (its dict round trip is exact, and `replace(arch=...)` carries no stale value); the properties
    `n_kv_heads` and `tied` resolve them. `from_hf` reads a Hugging Face config.json."""

    layers: int = 4
    """Transformer blocks. Split evenly over pp * virtual_stages, or as ParallelConfig.stage_layers says.
    0 is a model of its embedding and head alone (the theory prices a chunk's ends so); a layout needs one."""
    hidden: int = 64
    """Model width h. heads must divide it."""
    heads: int = 4
    """Attention (query) heads; tp must divide it (tensor parallelism splits attention by heads)."""
    ffn: int = 256
    """MLP inner width: fc1's outputs (gpt, gpt2: 4h), or each of SwiGLU's gate and up (llama); tp must divide it."""
    vocab: int = 256
    """Vocabulary size; tp must divide it (vocab-parallel embedding and loss); data="text" needs >= 256 (bytes)."""
    seq: int = 64
    """Sequence length s; 2 * cp must divide it (ring attention's zigzag halves). gpt, gpt2: the
    learned position table's size too."""
    experts: int = 0
    """Experts per MoE layer; 0 keeps dense MLPs. ep must divide it. With arch='llama': Mixtral."""
    top_k: int = 1
    """Experts each token is routed to (1 <= top_k <= experts)."""
    aux_loss_coef: float = 0.01
    """Weight of the Switch-Transformer load-balancing loss added to the LM loss (MoE only)."""
    arch: Arch = "gpt"
    """'gpt': labkit's toy (LayerNorm, learned positions, exact-GELU MLP, no biases, untied head);
    'gpt2': GPT-2 as published (biases in every Linear and LayerNorm, tanh GELU, learned
    positions, head tied to the token embedding); 'llama': RMSNorm, rotary positions, SwiGLU,
    grouped-query attention, no biases (Llama 2/3, Mistral; Mixtral with experts > 0)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention, Ainslie et al. 2023); must divide heads.
    None: heads (multi-head attention)."""
    tie_embeddings: bool | None = None
    """The LM head shares the token embedding's weight. None: the family's (gpt2 ties; gpt and
    llama do not — Llama 3.2 1B/3B tie, give True)."""
    rope_theta: float = 10000.0
    """RoPE base (llama only; Su et al. 2021). Llama 2: 1e4, Llama 3: 5e5, Mixtral: 1e6."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1's RoPE scaling (llama only); None: plain RoPE."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm / RMSNorm."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections only (llama family: Qwen2). gpt2 has biases everywhere anyway."""
    loss: Loss = "fp32"
    """How the cross-entropy is taken. 'fp32': the logits cast to fp32, then log-softmax and NLL
    (F.cross_entropy on logits.float(), as torchtitan calls it): keeps the fp32 log-probabilities,
    4 bytes a logit, and the backward makes fp32 gradients. 'fused': one function from the logits
    in the compute dtype, keeping them and each row's fp32 log-sum-exp, its gradient written in
    the compute dtype (flash-attn's CrossEntropyLoss, llm-foundry's default for MPT; Liger's keeps
    the same bytes). The same loss to rounding; in bf16 'fused' keeps half the bytes a logit."""

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # from a plain dict (to_dict, JSON)
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        check_fields(self)  # a wrong type or range is refused here, named, with a fix

    @classmethod
    def from_hf(cls, config, seq: int | None = None) -> ModelConfig:
        """The exact architecture of a Hugging Face config.json (a dict, or the file's path):
        LlamaForCausalLM (Llama 2, 3.1, 3.2), MistralForCausalLM, MixtralForCausalLM,
        Qwen2ForCausalLM, GPT2LMHeadModel. No weights, no network. `seq`: the training sequence
        (default the config's max_position_embeddings / n_positions). A field that changes the
        architecture in a way labkit does not build is refused, by name (labkit/config/hf.py)."""
        fields, found = hf_fields(config, seq)
        if found:
            raise ConfigError(found)
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: kv_heads, or heads when None."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (tie_embeddings, or the family's default)."""
        return self.family.ties if self.tie_embeddings is None else self.tie_embeddings

    # -- `arch` and `loss` decoded once (labkit/config/choices.py): the code reads these, never the names
    @property
    def family(self) -> Family:
        """What `arch` builds: .rms_norm, .rotary, .gated_mlp, .biases, .gelu_approximate, ..."""
        return choices.family(self.arch)

    @property
    def fused_loss(self) -> bool:
        """loss='fused': the logits kept in the compute dtype with their fp32 log-sum-exp."""
        return choices.fused_loss(self.loss)

    def num_params(self) -> int:
        """Parameter count Ψ of the full model (every weight, counted once; a tied head is the
        embedding). labkit.theory.num_params counts the same from the parameter list."""
        h, f, v, s, e = self.hidden, self.ffn, self.vocab, self.seq, self.experts
        kv = self.n_kv_heads * self.head_dim
        fam = self.family
        norm = h if fam.rms_norm else 2 * h  # RMSNorm has no bias
        attn = 2 * h * h + 2 * h * kv
        if fam.biases or self.qkv_bias:
            attn += h + 2 * kv  # q, k, v biases
        if fam.biases:
            attn += h  # the output projection's bias
        mats = 3 if fam.gated_mlp else 2  # SwiGLU: gate, up, down
        if e:
            mlp = h * e + e * mats * h * f
        else:
            mlp = mats * h * f + (f + h if fam.biases else 0)
        pos = 0 if fam.rotary else s * h
        return v * h + pos + self.layers * (2 * norm + attn + mlp) + norm + (0 if self.tied else h * v)


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
    """Context-parallel degree: the sequence split over ranks (zigzag), attention as cp_kind says."""
    ep: int = 1
    """Expert-parallel degree: ranks that share the experts and split the batch (needs experts > 0)."""
    sharding: Sharding = "none"
    """'none' (DDP), 'zero1', 'zero2', 'zero3' (ZeRO stages) or 'fsdp' (per-block units)."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout regions along the sequence inside a TP group (needs tp > 1)."""
    microbatches: int = 1
    """Microbatches per step: pipeline microbatches, or gradient accumulation when pp == 1."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved' (needs virtual_stages > 1), or a
    zero-bubble one, whose backward is split into input and weight gradients: 'zbh1' (1F1B's
    memory), 'zbv' and 'dualpipev' (two chunks per rank in a V: virtual_stages=2)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B; 2 for the V schedules)."""
    stage_layers: tuple[int, ...] = ()
    """Blocks of each virtual stage, in stage order (pp * virtual_stages entries summing to the
    model's layers), for uneven stages: Llama 3.1 405B's 126 layers on 8 stages as
    (15, 16, 16, 16, 16, 16, 16, 15). Empty: layers split evenly."""
    global_batch: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and microbatches."""
    impl: Impl = "lab"
    """'lab' runs labkit's readable implementations; 'torch' runs PyTorch's own (DDP, FSDP2, DTensor, pipelining)."""
    precision: Precision = "fp32"
    """'fp32'; 'bf16': bf16 compute with fp32 master weights and optimizer state; 'fp8': as bf16,
    with the linear layers' matmuls in fp8 (per-tensor scales, torchao's float8 training) and
    FSDP's all-gather in fp8 (the theory only: the engines refuse it, validation says why)."""
    checkpoint_activations: Checkpointing = False
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
    cp_kind: ContextKind = "ring"
    """How the cp ranks attend across their shards (Megatron's --cp-comm-type): 'ring' (K/V passed
    round, p2p), 'allgather' (K/V gathered once per layer, all_gather), 'ulysses' (all-to-all from
    sequence to head shards and back, a2a; heads and KV heads per tp rank must divide by cp)."""

    dp_replicate: int = 1
    """HSDP (torchtitan's dp_replicate x dp_shard): dp as replicas of shard groups of dp / dp_replicate ranks,
    the sharding inside a group, its reduced shard all-reduced across; both at dp's place in `order`, shard
    inside (layout/mesh.py SUB_DIMS). 1: one flat dp dim."""

    def __post_init__(self):
        if isinstance(self.stage_layers, list):  # from a plain dict (JSON): the config stays hashable
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        check_fields(self)  # a wrong type or range is refused here, named, with a fix

    # -- the choices decoded once (labkit/config/choices.py): the code reads these, never the names
    @property
    def sharded(self) -> Sharded:
        """What `sharding` shards: .stage (ZeRO's 0-3), .optimizer, .grads, .params, .fsdp (FSDP's units)."""
        return choices.sharded(self.sharding)

    @property
    def reshards(self) -> bool:
        """Gathered parameters freed after each unit's forward and gathered again for its backward:
        ZeRO-3 always, FSDP as reshard_after_forward says; False where parameters are not sharded."""
        return self.sharded.params and (self.reshard_after_forward or not self.sharded.fsdp)

    @property
    def pipeline(self) -> PipelineShape:
        """What `schedule` does: .forwards_first, .one_f_one_b, .interleaved, .v_shaped, .splits_backward."""
        return choices.pipeline_shape(self.schedule)

    @property
    def torch_impl(self) -> bool:
        """impl='torch': PyTorch's own DDP, FSDP2, DTensor and pipelining run, not labkit's."""
        return choices.torch_impl(self.impl)

    @property
    def numerics(self) -> Numerics:
        """What `precision` computes in: .mixed (low-precision compute, fp32 masters), .fp8 (fp8 matmuls)."""
        return choices.numerics(self.precision)

    @property
    def recomputation(self) -> Recomputation:
        """What checkpoint_activations rebuilds: .recomputes, .reruns_forward, .attention_only, .per_op."""
        return choices.recomputation(self.checkpoint_activations)

    @property
    def context(self) -> ContextComm:
        """What `cp_kind` moves: .ring (K/V hops), .gathers (K/V all-gathered), .splits_heads (Ulysses)."""
        return choices.context_comm(self.cp_kind)

    @property
    def recompute(self) -> Recompute:
        """'none', 'full', 'selective' or 'op': checkpoint_activations by name (True is 'full')."""
        return self.recomputation.mode

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
    data: Data = "synthetic"
    """'synthetic' (the synthetic language) or 'text' (the corpus; the ranks also compute the validation loss)."""
    return_params: bool = False
    """Bring back every rank's part of the final parameters (res.params), to check against the reference."""
    audit: bool = False
    """Run a TorchDispatchMode beside the comm meter and count what it sees (slow; tests use it)."""
    comm_log: bool = True
    """Record collectives in the job's log; False only for the overhead benchmark (nothing is recorded)."""

    def __post_init__(self):
        check_fields(self)

    @property
    def trains_on_text(self) -> bool:
        """data='text': the corpus, and the ranks compute the validation loss."""
        return choices.trains_on_text(self.data)

    @classmethod
    def from_dict(cls, d: dict) -> RunSpec:
        """The nested configs come back as dataclasses (to_dict made them dicts)."""
        nested = {"parallel": ParallelConfig, "model": ModelConfig, "optim": OptimConfig}
        return super().from_dict({k: nested[k].from_dict(v) if k in nested else v for k, v in d.items()})
