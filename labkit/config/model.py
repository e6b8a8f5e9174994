"""What to train: ModelConfig (and Llama 3.1's RopeScaling), its fields checked when built, its
choices decoded once (choices.py); `from_hf` reads a Hugging Face config.json (hf/)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from labkit.config import choices
from labkit.config.base import _Dict
from labkit.config.choices import (
    Arch,
    ConfigError,
    Family,
    Loss,
    Router,
)
from labkit.config.hf import hf_fields
from labkit.config.latent import YarnRope, mla_shapes
from labkit.config.norms import Norm, NormKind, norm_kind
from labkit.config.validation import check_fields


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
    """Vocabulary size (the tokens that exist); tp must divide it (vocab-parallel embedding and loss)
    unless vocab_divisible_by pads it; data="text" needs >= 256 (bytes)."""
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
    grouped-query attention, no biases (Llama 2/3, Mistral; Mixtral with experts > 0); 'deepseek_v3':
    llama's norms and SwiGLU with DeepSeek-V3's multi-head latent attention (the MLA fields below)."""
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
    norm: Norm = "default"
    """The blocks' and the head's norms: 'default' the family's (RMSNorm for llama, deepseek_v3, gpt_oss;
    LayerNorm with its bias for gpt and gpt2; Gemma 3's (1 + w) RMSNorm, which admits no other), or one a
    job names: 'rmsnorm', 'layernorm' (weight and bias: Megatron-LM's default whatever its MLP and
    positions), 'layernorm_nobias'. MLA's latent norms and Qwen3's q/k norms stay RMSNorm."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections only (llama family: Qwen2). gpt2 has biases everywhere anyway."""
    loss: Loss = "fp32"
    """How the cross-entropy is taken. 'fp32': the logits cast to fp32, then log-softmax and NLL
    (F.cross_entropy on logits.float(), as torchtitan calls it): keeps the fp32 log-probabilities,
    4 bytes a logit, and the backward makes fp32 gradients. 'fused': one function from the logits
    in the compute dtype, keeping them and each row's fp32 log-sum-exp, its gradient written in
    the compute dtype (flash-attn's CrossEntropyLoss, llm-foundry's default for MPT; Liger's keeps
    the same bytes). The same loss to rounding; in bf16 'fused' keeps half the bytes a logit."""
    vocab_divisible_by: int | None = None
    """Megatron's --make-vocab-size-divisible-by (its default 128): the embedding and the head get
    `padded_vocab(tp)` rows, vocab rounded up to a multiple of vocab_divisible_by * tp, so any vocab
    splits over any tp (GPT-2's 50257). The padding rows start at zero and their logits are masked
    out of the loss (-inf), so the model trains exactly as the unpadded one. None: no padding."""
    # -- multi-head latent attention (arch='deepseek_v3'; labkit/config/latent.py, engines/mla.py); None elsewhere
    q_lora_rank: int | None = None
    """Width of the queries' latent c_q (DeepSeek-V3: 1536); None: queries projected directly from x (V2-Lite)."""
    kv_lora_rank: int | None = None
    """Width of the compressed key/value latent c_kv (DeepSeek-V3: 512)."""
    qk_nope_head_dim: int | None = None
    """Per head, the query/key dimensions without rotary positions (DeepSeek-V3: 128; 0: none)."""
    qk_rope_head_dim: int | None = None
    """Per head, the rotated query dimensions; the rotated key is one, shared by every head (DeepSeek-V3: 64)."""
    v_head_dim: int | None = None
    """Per head, the value's width (DeepSeek-V3: 128)."""
    yarn: YarnRope | None = None
    """DeepSeek-V3's YaRN RoPE with mscale (arch='deepseek_v3'); None: plain RoPE."""
    # -- fine-grained MoE (Qwen3-MoE, DeepSeek-V3); the defaults are Mixtral's layer (engines/moe.py)
    moe_ffn: int | None = None
    """An expert's inner width (HF moe_intermediate_size), apart from the dense MLP's `ffn`. None: ffn."""
    shared_experts: int = 0
    """Shared experts beside the routed ones (HF n_shared_experts; DeepSeekMoE, Dai et al. 2024): one
    dense MLP of width shared_experts * moe_ffn that every token passes through, replicated over ep."""
    norm_topk_prob: bool | None = None
    """Divide the top-k gates by their sum (HF norm_topk_prob). None: the family's (llama: True, Mixtral's
    router; gpt, gpt2: False, Switch's)."""
    router: Router = "softmax"
    """'softmax' over the experts, or each expert's 'sigmoid' (DeepSeek-V3, HF scoring_func) with the
    aux-loss-free bias: a buffer added to the affinities for the choice only (engines/moe.py)."""
    n_group: int = 1
    """Expert groups for group-limited routing (HF n_group; DeepSeek-V3 routes to at most topk_group of
    them, its nodes); must divide experts. 1: no limit."""
    topk_group: int = 1
    """Groups a token's experts may come from (HF topk_group), <= n_group; ignored when n_group is 1."""
    routed_scaling_factor: float = 1.0
    """The routed experts' gates scaled by this (HF routed_scaling_factor; DeepSeek-V3: 2.5)."""
    dense_layers: int = 0
    """The first dense_layers blocks keep a dense MLP of width ffn (HF first_k_dense_replace; DeepSeek-V3: 3)."""
    bias_update_speed: float = 0.0
    """γ of the aux-loss-free balance (DeepSeek-V3 section 2.1.2: 0.001): after each step every expert's
    bias moves by γ towards balance, from the global batch's loads. 0: the bias stays (sigmoid router only)."""
    # -- the dense attention families (Qwen3, SmolLM3, Gemma 3); each default leaves every
    # older model exactly as it was (tests/theory_snapshot.py ADDED_AT_DEFAULT)
    kv_channels: int | None = None
    """Width of one attention head (HF head_dim, Megatron's --kv-channels) when it is not hidden / heads:
    q is heads * kv_channels wide, k and v kv_heads * kv_channels (Qwen3 and Gemma 3 27B: 128,
    Gemma 3 1B-12B: 256). None: hidden / heads."""
    qk_norm: bool = False
    """An RMSNorm over head_dim applied to every head of q and of k before RoPE (Qwen3, Gemma 3:
    transformers' q_norm / k_norm; one weight per norm, shared by the heads)."""
    nope_interval: int = 0
    """Every nope_interval-th layer (i + 1 divisible by it) has no RoPE (SmolLM3's
    no_rope_layer_interval, 4). 0: every layer rotates."""
    sliding_window: int | None = None
    """Sliding-window attention: a query at position i sees keys at i - sliding_window < j <= i
    (transformers' sliding_window_overlay), on the layers window_pattern makes local. A window of
    seq or more changes nothing. None: every layer attends to the whole causal prefix."""
    window_pattern: int = 0
    """With sliding_window: every window_pattern-th layer (i + 1 divisible by it) is global, the
    others local (Gemma 3: 6, five local to one global). 0: every layer is local."""
    rope_local_theta: float | None = None
    """RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq, 10000.0); None: rope_theta."""
    rope_linear_factor: float = 1.0
    """Linear RoPE scaling of the global layers (HF rope_type 'linear', Chen et al. 2023 position
    interpolation): the frequencies divided by it (Gemma 3 4B-27B: 8.0). 1.0: none."""
    query_pre_attn_scalar: float | None = None
    """Attention scores scaled by query_pre_attn_scalar^-1/2 rather than head_dim^-1/2 (Gemma 3; 27B:
    168 = hidden / heads, while its head_dim is 128). None: head_dim."""

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # from a plain dict (to_dict, JSON)
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if isinstance(self.yarn, dict):
            object.__setattr__(self, "yarn", YarnRope.from_dict(self.yarn))
        check_fields(self)  # a wrong type or range is refused here, named, with a fix

    def __hash__(self) -> int:
        # the fields' hash, once: the planner's caches key on the model ~300,000 times a search, and the
        # dataclass's own hash rebuilds a tuple of its 50 fields every time (frozen: it cannot change)
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # without the cached hash: a string's hash differs from process to process (PYTHONHASHSEED)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    @classmethod
    def from_hf(cls, config, seq: int | None = None) -> ModelConfig:
        """The exact architecture of a Hugging Face config.json (a dict, or the file's path):
        LlamaForCausalLM (Llama 2, 3.1, 3.2), MistralForCausalLM, MixtralForCausalLM,
        Qwen2ForCausalLM, GPT2LMHeadModel. No weights, no network. `seq`: the training sequence
        (default the config's max_position_embeddings / n_positions). A field that changes the
        architecture in a way labkit does not build is refused, by name (labkit/config/hf/)."""
        fields, found = hf_fields(config, seq)
        if found:
            raise ConfigError(found)
        return cls(**fields)

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding and head on a `tp`-way layout (Megatron core_v0.19.0 vocab_utils.py)."""
        multiple = (self.vocab_divisible_by or 0) * tp
        return -(-self.vocab // multiple) * multiple if multiple else self.vocab

    def padded(self, tp: int = 1) -> ModelConfig:
        """The model as a `tp`-way layout's ranks hold it, padding rows counted as vocabulary: what
        the theory prices. num_params() of self stays the published (unpadded) count."""
        off = self.vocab_divisible_by is None
        return self if off else self.replace(vocab=self.padded_vocab(tp), vocab_divisible_by=None)

    @property
    def head_dim(self) -> int:
        """One head's width: kv_channels, or hidden / heads."""
        return self.hidden // self.heads if self.kv_channels is None else self.kv_channels

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of block `layer`, or None where it attends to the whole causal prefix
        (a global layer, or a window of seq or more, which masks nothing)."""
        w = self.sliding_window
        if w is None or w >= self.seq:
            return None
        pattern = self.window_pattern
        return None if pattern and (layer + 1) % pattern == 0 else w

    def layer_rotates(self, layer: int) -> bool:
        """Whether block `layer` applies RoPE (a rotary family, and not one of SmolLM3's NoPE layers)."""
        n = self.nope_interval
        return self.family.rotary and not (n and (layer + 1) % n == 0)

    def layer_local(self, layer: int) -> bool:
        """Whether block `layer` is a sliding-window layer by its pattern, whatever seq (its RoPE base
        is rope_local_theta, as transformers picks the tables by layer type)."""
        pattern = self.window_pattern
        return self.sliding_window is not None and not (pattern and (layer + 1) % pattern == 0)

    @property
    def expert_ffn(self) -> int:
        """An expert's inner width: moe_ffn, or ffn when None."""
        return self.ffn if self.moe_ffn is None else self.moe_ffn

    @property
    def renormalises_gates(self) -> bool:
        """Whether the top-k gates are divided by their sum: norm_topk_prob, or the family's (SwiGLU experts)."""
        return self.family.gated_mlp if self.norm_topk_prob is None else self.norm_topk_prob

    @property
    def sigmoid_router(self) -> bool:
        """router='sigmoid': per-expert sigmoid affinities and the aux-loss-free bias buffer."""
        return choices.sigmoid_router(self.router)

    def moe_layer(self, i: int) -> bool:
        """Whether block i has an MoE layer (the first dense_layers stay dense)."""
        return self.experts > 0 and i >= self.dense_layers

    @property
    def moe_layers(self) -> int:
        """Blocks with an MoE layer."""
        return max(0, self.layers - self.dense_layers) if self.experts else 0

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
    def norms(self) -> NormKind:
        """What `norm` builds: .rms (RMSNorm rather than LayerNorm), .bias."""
        return norm_kind(self.arch, self.norm)

    @property
    def fused_loss(self) -> bool:
        """loss='fused': the logits kept in the compute dtype with their fp32 log-sum-exp."""
        return choices.fused_loss(self.loss)

    def num_params(self) -> int:
        """Parameter count Ψ of the full model (every weight, counted once; a tied head is the
        embedding). labkit.theory.num_params counts the same from the parameter list."""
        h, f, v, s, e = self.hidden, self.ffn, self.vocab, self.seq, self.experts
        kv, q = self.n_kv_heads * self.head_dim, self.heads * self.head_dim
        fam = self.family
        norm = 2 * h if self.norms.bias else h  # a weight, and LayerNorm's bias
        attn = 2 * h * q + 2 * h * kv + (2 * self.head_dim if self.qk_norm else 0)
        if fam.latent_attention:  # MLA's own projections and latent norms (labkit/config/latent.py)
            attn = sum(math.prod(shape) for _, shape in mla_shapes(self))
        if fam.biases or self.qkv_bias:
            attn += q + 2 * kv  # q, k, v biases
        if fam.attention_biases:  # GPT-OSS: q, k, v and o biases, and a sink per head
            attn += q + 2 * kv + h + self.heads
        if fam.biases:
            attn += h  # the output projection's bias
        mats = 3 if fam.gated_mlp else 2  # SwiGLU: gate, up, down
        dense = mats * h * f + (f + h if fam.biases else 0)
        fe = self.expert_ffn
        moe = h * e + e * mats * h * fe + mats * h * fe * self.shared_experts  # router, routed, shared
        if self.shared_experts and fam.biases:  # gpt2's shared MLP has its biases
            moe += fe * self.shared_experts + h
        if fam.clamped_experts:  # GPT-OSS: the router's bias, each expert's gate, up and down biases
            moe += e + e * (2 * fe + h)
        pos = 0 if fam.rotary else s * h
        norms = 4 if fam.sandwich_norm else 2  # Gemma: each sublayer's input and output
        blocks = self.layers * (norms * norm + attn) + self.moe_layers * moe + (self.layers - self.moe_layers) * dense
        return v * h + pos + blocks + norm + (0 if self.tied else h * v)
