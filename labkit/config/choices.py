"""The choices the configs offer, each defined once: its `Literal` type, the tuple of its values,
and its one decode (torchtitan's `match policy: case ...: case _: raise`) into what the code
needs. The configs' properties (labkit/config/model.py, parallel.py) read these decodes; code that holds a
bare name (a schedule passed to layout/schedules.py, a reference's precision) calls them itself.
Nothing else in labkit compares a choice with a string (tests/test_choices.py reads the code).

Plain Python, the bottom rung of the ladder: the configs' modules and validation.py import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal, get_args


class ConfigError(ValueError):
    """A layout, model or argument that cannot run; the message lists every problem and a fix."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) with this configuration:\n{lines}")


DIMS = ("tp", "cp", "ep", "dp", "pp")
"""The mesh dimensions, in the default order (innermost first, Megatron's convention)."""

Sharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)
Schedule = Literal["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""Pipeline schedules (labkit/layout/orders.py); the last three split backward into B and W."""
ContextKind = Literal["ring", "allgather", "ulysses", "hierarchical"]
CONTEXT_KINDS: tuple[str, ...] = get_args(ContextKind)
"""How a context-parallel group attends across its sequence shards (engines/parallel/context/ and
context/kinds.py): K/V round a ring, K/V all-gathered, an all-to-all to head shards (Ulysses), or
both levels: an all-to-all inside runs of cp_a2a ranks and a ring across them (hierarchical)."""
Impl = Literal["lab", "torch"]
IMPLS: tuple[str, ...] = get_args(Impl)
Precision = Literal["fp32", "bf16", "fp8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
Checkpointing = Literal[False, True, "full", "selective", "op"]
CHECKPOINTING: tuple = get_args(Checkpointing)
"""checkpoint_activations values: off; full recomputation (True is "full"); Korthikanti et al.'s
selective (the attention core); torchtitan's per-op selective policy ("op": the theory only)."""
Recompute = Literal["none", "full", "selective", "op"]
"""A checkpoint_activations value by name (ParallelConfig.recompute)."""
Arch = Literal["gpt", "gpt2", "llama", "deepseek_v3", "gemma3", "gpt_oss"]
ARCHS: tuple[str, ...] = get_args(Arch)
Router = Literal["softmax", "sigmoid"]
ROUTERS: tuple[str, ...] = get_args(Router)
"""How an MoE router scores the experts (ModelConfig.router): a softmax over them (Switch, Mixtral,
Qwen3-MoE) or each expert's own sigmoid (DeepSeek-V3, technical report section 2.1.2, eq. 15)."""
Loss = Literal["fp32", "fused"]
LOSSES: tuple[str, ...] = get_args(Loss)
"""How ModelConfig.loss takes the cross-entropy."""
Data = Literal["synthetic", "text"]
DATA: tuple[str, ...] = get_args(Data)
"""What a run trains on: the synthetic language (engines/data.py) or the Shakespeare corpus in bytes
(labkit/layout/text.py; needs vocab >= 256)."""

FIXES = {
    "checkpoint_activations": "pick one of those (True is 'full')",
    "loss": "'fused' keeps the logits in the compute dtype",
    "data": "try 'text' (Shakespeare, in bytes) or 'synthetic'",
    "cp_kind": "'ring' (K/V passed round), 'allgather' (K/V gathered), 'ulysses' (all-to-all to heads), "
    "'hierarchical' (all-to-all inside cp_a2a ranks, ring across)",
}
"""The fix an unknown value's message offers, where it says more than 'pick one of those'."""


def unknown(name: str, value, allowed: tuple) -> str:
    """The problem of a value that is not one of a choice's."""
    return f"{name}={value!r} is not one of {list(allowed)}; {FIXES.get(name, 'pick one of those')}"


# -- the decodes: one per choice, exhaustive -----------------------------------------------------
@dataclass(frozen=True)
class Sharded:
    """What a `sharding` shards over the data-parallel group (Rajbhandari et al., SC 2020, section 5)."""

    stage: int
    """ZeRO's stage: 0 replicates every model state (DDP); 1 shards the optimizer's; 2 the gradients
    too; 3 the parameters too, each unit gathered before it runs (zero3, fsdp)."""
    fsdp: bool = False
    """PyTorch FSDP's units (the root, then one per block), resharded as reshard_after_forward says;
    ZeRO-3's are one per top-level module, always resharded (labkit/layout/flat.py)."""

    @property
    def optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def grads(self) -> bool:
        return self.stage >= 2

    @property
    def params(self) -> bool:
        return self.stage >= 3

    @property
    def per_module_units(self) -> bool:
        """ZeRO-3's units: one per top-level module (the embedding, each block, the head), always resharded."""
        return self.params and not self.fsdp


@cache
def zero_stages() -> dict[int, Sharding]:
    """ZeRO's stages by the sharding that is each in ZeRO's own units ({0: 'none', ...; FSDP: 3, other units})."""
    return {sharded(s).stage: s for s in SHARDINGS if not sharded(s).fsdp}


@cache
def sharded(sharding: Sharding) -> Sharded:
    match sharding:
        case "none":
            # DDP: every model state replicated over the data ranks
            return Sharded(0)
        case "zero1":
            return Sharded(1)
        case "zero2":
            return Sharded(2)
        case "zero3":
            return Sharded(3)
        case "fsdp":
            # ZeRO-3's sharding in FSDP's units (a root, then one per block)
            return Sharded(3, fsdp=True)
        case _:
            # the one place an unknown value is refused: whatever reads the decode can trust it
            raise ConfigError([unknown("sharding", sharding, SHARDINGS)])


@dataclass(frozen=True)
class PipelineShape:
    """What a pipeline `schedule` is, as its rules and the theory's shortcuts need it."""

    forwards_first: bool = False
    """Every forward before the first backward (GPipe): all m microbatches in flight."""
    one_f_one_b: bool = False
    """Plain 1F1B, one chunk a rank (Narayanan et al. 2021): min(m, p - r) in flight."""
    interleaved: bool = False
    """Megatron's interleaved 1F1B: virtual_stages >= 2 chunks a rank, in a loop."""
    v_shaped: bool = False
    """Two chunks a rank placed in a V, on stages r and 2p - 1 - r (ZB-V, DualPipeV)."""
    splits_backward: bool = False
    """Backward split into B (the input's gradient) and W (the weights'): the zero-bubble ones."""
    microbatches_per_stage: int = 0
    """Microbatches it needs per pipeline rank (DualPipeV: 2, one per stage of the V); 0: any."""


@cache
def pipeline_shape(schedule: Schedule) -> PipelineShape:
    match schedule:
        case "gpipe":
            # GPipe (Huang et al. 2019): every forward first, all m microbatches in flight
            return PipelineShape(forwards_first=True)
        case "1f1b":
            return PipelineShape(one_f_one_b=True)
        case "interleaved":
            return PipelineShape(interleaved=True)
        case "zbh1":  # 1F1B's memory, W deferred into the bubble
            return PipelineShape(splits_backward=True)
        case "zbv":
            # ZB-V (Qi et al. 2024, section 6): two chunks a rank in a V, backward split
            return PipelineShape(v_shaped=True, splits_backward=True)
        case "dualpipev":
            # DualPipeV (DeepSeek-V3, section 3.2.1): two microbatches a rank, one per stage of its V
            return PipelineShape(v_shaped=True, splits_backward=True, microbatches_per_stage=2)
        case _:
            raise ConfigError([unknown("schedule", schedule, SCHEDULES)])


@cache
def torch_impl(impl: Impl) -> bool:
    """Whether `impl` runs PyTorch's own strategies (DDP, FSDP2, DTensor, pipelining) rather than labkit's."""
    match impl:
        case "lab":
            return False
        case "torch":
            return True
        case _:
            raise ConfigError([unknown("impl", impl, IMPLS)])


@dataclass(frozen=True)
class Numerics:
    """What a `precision` computes in."""

    mixed: bool
    """Low-precision compute (bf16; fp8's activations are bf16 too) beside fp32 master weights and
    optimizer state; else fp32 everywhere."""
    fp8: bool
    """The linear layers' matmuls in fp8 (per-tensor scales) and FSDP's gathers in fp8."""


@cache
def numerics(precision: Precision) -> Numerics:
    match precision:
        case "fp32":
            return Numerics(mixed=False, fp8=False)
        case "bf16":
            return Numerics(mixed=True, fp8=False)
        case "fp8":
            # fp8: matmuls in fp8, activations in bf16, fp32 masters (torchao's float8 training)
            return Numerics(mixed=True, fp8=True)
        case _:
            raise ConfigError([unknown("precision", precision, PRECISIONS)])


@dataclass(frozen=True)
class ContextComm:
    """How a `cp_kind` moves the sequence between the cp ranks. Every kind keeps the zigzag layout
    (each rank two chunks, 2cp chunks in all) and so the same balanced causal work."""

    ring: bool
    """K/V blocks pass round the ring, one hop per step, overlapped with the block in hand (Liu et
    al. 2023); dK/dV accumulators follow them home in backward."""
    gathers: bool
    """K/V all-gathered once per layer, then attended to locally (Llama 3, Dubey et al. 2024,
    section 3.3.2: cheap under GQA, where K/V are small); dK/dV reduce-scattered back."""
    splits_heads: bool
    """An all-to-all turns sequence shards into head shards before attention and back after
    (DeepSpeed-Ulysses, Jacobs et al. 2023): the local heads and KV heads must divide by the
    all-to-all's ranks (cp, or cp_a2a with the ring too)."""

    @property
    def hierarchical(self) -> bool:
        """Both levels (Megatron's 'a2a+p2p'): the all-to-all inside runs of cp_a2a consecutive cp
        ranks, then a ring across the runs with the run's tokens."""
        return self.ring and self.splits_heads


@cache
def context_comm(cp_kind: ContextKind) -> ContextComm:
    match cp_kind:
        case "ring":
            return ContextComm(ring=True, gathers=False, splits_heads=False)
        case "allgather":
            return ContextComm(ring=False, gathers=True, splits_heads=False)
        case "ulysses":
            return ContextComm(ring=False, gathers=False, splits_heads=True)
        case "hierarchical":
            return ContextComm(ring=True, gathers=False, splits_heads=True)
        case _:
            raise ConfigError([unknown("cp_kind", cp_kind, CONTEXT_KINDS)])


@dataclass(frozen=True)
class Recomputation:
    """What a checkpoint_activations value rebuilds in backward."""

    mode: Recompute
    """Its name: 'none', 'full', 'selective' or 'op' (True is 'full')."""
    reruns_forward: bool
    """A block's forward runs again, its tensor- and expert-parallel collectives too ('full', 'op')."""
    attention_only: bool
    """Only the attention core is rebuilt: its log-sum-exp is not kept ('selective')."""
    per_op: bool
    """torchtitan's per-op policy: every second matmul's output and the attention's kept ('op')."""

    @property
    def recomputes(self) -> bool:
        return self.reruns_forward or self.attention_only

    @property
    def keeps_input_only(self) -> bool:
        """'full': a block keeps its input only (Chen et al. 2016)."""
        return self.reruns_forward and not self.per_op


def recomputation(checkpoint_activations: Checkpointing | Recompute) -> Recomputation:
    """The decode of a checkpoint_activations value, or of its name (`Recomputation.mode`)."""
    match checkpoint_activations:
        case False | "none":
            # False and 'none' alike: the config holds values, ParallelConfig.recompute names them
            return Recomputation("none", reruns_forward=False, attention_only=False, per_op=False)
        case True | "full":
            # True is 'full' (Chen et al. 2016): a block keeps its input, its forward runs again
            return Recomputation("full", reruns_forward=True, attention_only=False, per_op=False)
        case "selective":
            # Korthikanti et al. 2022, section 4.2: the attention core alone is rebuilt
            return Recomputation("selective", reruns_forward=False, attention_only=True, per_op=False)
        case "op":
            # torchtitan's per-op policy: every second matmul's output kept, the rest rebuilt
            return Recomputation("op", reruns_forward=True, attention_only=False, per_op=True)
        case _:
            raise ConfigError([unknown("checkpoint_activations", checkpoint_activations, CHECKPOINTING)])


@dataclass(frozen=True)
class Family:
    """What a model family (`arch`) builds: its norms, positions, MLP, biases and head."""

    rms_norm: bool = False
    """RMSNorm (a weight, no bias; computed in fp32) rather than LayerNorm."""
    rotary: bool = False
    """Rotary positions (RoPE) rather than a learned position table."""
    gated_mlp: bool = False
    """SwiGLU: gate, up and down projections (and experts with three weights) rather than a GELU MLP."""
    biases: bool = False
    """A bias on every Linear (and LayerNorm), as GPT-2 has."""
    takes_qkv_bias: bool = False
    """ModelConfig.qkv_bias may add biases to q, k and v alone (the llama family: Qwen2)."""
    gelu_approximate: str = "none"
    """F.gelu's `approximate` for the GELU MLP: 'tanh' (GPT-2's) or 'none' (exact)."""
    ties: bool = False
    """The head shares the token embedding unless tie_embeddings says otherwise."""
    latent_attention: bool = False
    """Multi-head latent attention (DeepSeek-V2/V3, engines/mla.py) rather than multi-head / grouped-query."""
    geglu: bool = False
    """The gated MLP's activation is the tanh GELU (GeGLU, Shazeer 2020) rather than SiLU (Gemma)."""
    offset_norm: bool = False
    """RMSNorm scales by (1 + w), w initialised at 0, computed in fp32 (Gemma's Gemma3RMSNorm)."""
    scaled_embedding: bool = False
    """The token embedding is multiplied by sqrt(hidden), in the compute dtype (Gemma3TextScaledWordEmbedding)."""
    sandwich_norm: bool = False
    """Four norms a block: each sublayer's output is normed too before the residual add (Gemma 2/3)."""
    attention_biases: bool = False
    """Biases on q, k, v and o (GPT-OSS's attention_bias), the rest of the model without."""
    sinks: bool = False
    """A learned logit per query head in each softmax's denominator, no value behind it (GPT-OSS's sinks)."""
    clamped_experts: bool = False
    """GPT-OSS's experts: router and experts with biases, softmax over the top-k router logits, the
    clamped SwiGLU (up + 1) · g σ(1.702 g), g <= 7, |up| <= 7 (transformers GptOssExperts._apply_gate)."""


@cache
def family(arch: Arch) -> Family:
    match arch:
        case "gpt":  # labkit's toy: LayerNorm, learned positions, exact GELU, no biases
            return Family()
        case "gpt2":
            # GPT-2 (Radford et al. 2019): biases everywhere, tanh GELU ('gelu_new'), a tied head
            return Family(biases=True, gelu_approximate="tanh", ties=True)
        case "llama":
            # Llama (Touvron et al. 2023): RMSNorm, RoPE, SwiGLU, no biases (Qwen2 adds q, k, v's)
            return Family(rms_norm=True, rotary=True, gated_mlp=True, takes_qkv_bias=True)
        case "deepseek_v3":
            # DeepSeek-V3 (arXiv 2412.19437, section 2.1): llama's norms and SwiGLU, multi-head latent attention
            return Family(rms_norm=True, rotary=True, gated_mlp=True, latent_attention=True)
        case "gemma3":
            # Gemma 3 (Gemma Team 2025; transformers' modeling_gemma3.py): (1 + w) RMSNorm before and
            # after each sublayer, GeGLU with the tanh GELU, sqrt(h)-scaled embedding tied to the head
            return Family(
                rms_norm=True,
                rotary=True,
                gated_mlp=True,
                gelu_approximate="tanh",
                ties=True,
                geglu=True,
                offset_norm=True,
                scaled_embedding=True,
                sandwich_norm=True,
            )
        case "gpt_oss":
            # GPT-OSS (OpenAI 2025 model card; transformers' modeling_gpt_oss.py): llama's RMSNorm, RoPE and
            # a gated MLP, biased attention with sinks, MoE experts with biases and a clamped SwiGLU
            return Family(
                rms_norm=True, rotary=True, gated_mlp=True, attention_biases=True, sinks=True, clamped_experts=True
            )
        case _:
            raise ConfigError([unknown("arch", arch, ARCHS)])


@cache
def sigmoid_router(router: Router) -> bool:
    """Whether the router's affinities are per-expert sigmoids (DeepSeek-V3) rather than a softmax."""
    match router:
        case "softmax":
            return False
        case "sigmoid":
            return True
        case _:
            raise ConfigError([unknown("router", router, ROUTERS)])


@cache
def fused_loss(loss: Loss) -> bool:
    """Whether the cross-entropy keeps the logits in the compute dtype and their fp32 log-sum-exp
    (one fused function) rather than fp32 log-probabilities."""
    match loss:
        case "fp32":
            return False
        case "fused":
            return True
        case _:
            raise ConfigError([unknown("loss", loss, LOSSES)])


@cache
def trains_on_text(data: Data) -> bool:
    """Whether a run reads the corpus (and the ranks compute a validation loss) rather than the synthetic language."""
    match data:
        case "synthetic":
            return False
        case "text":
            return True
        case _:
            raise ConfigError([unknown("data", data, DATA)])
