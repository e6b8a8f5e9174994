"""The work of one microbatch on one rank, op by op: FLOPs and bytes moved of each matmul, the
attention kernel and the memory-bound ops of a block, of the head (final norm, LM head, loss) and
of the embedding, as eager PyTorch runs them. theory/planner/timing.py prices each op on a roofline.

With T = b·s/cp tokens of the microbatch on this rank, t = tp, e the activation bytes:
  matmul     2·T·K·N forward for a (K -> N) weight of the rank (column-parallel: N/t, row-parallel
             K/t), bytes e·(TK + KN + TN); backward twice that (input and weight gradients)
  attention  causal: half of 4·b·(s/cp)·s·h/t forward (QKᵀ and PV), 2.5 times that backward
             (FlashAttention-2: Dao 2023, section 3.1, five products against two)
  memory     bytes per element of each eager kernel (below); backward twice the forward
fp8 (torchao float8, dynamic per-tensor scales): matmul operands in 1 byte at the fp8 rate, plus
the casts: an amax pass and a cast of each input and weight forward (read e, read e, write 1),
of each output gradient backward, and the transposed copies the backward products need.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from labkit.config import ModelConfig
from labkit.config.choices import numerics
from labkit.layout.precision import ELEM
from labkit.theory.exact.experts import is_expert
from labkit.theory.exact.latent import kernel_width
from labkit.theory.exact.model import param_shapes

ROWWISE = ("attn.wo", "mlp.fc2", "mlp.down")
"""Row-parallel layers under tp (their input features are split); every other matrix of a block
is column-parallel (layout/tensor.py), but LATENT's."""
LATENT = ("attn.wq_a", "attn.wkv_a")
"""MLA's down-projections to its latents: whole on every tp rank (layout/tensor.py 'latent')."""


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    """'matmul', 'fp8-matmul', 'attention' or 'memory'."""
    flops: float
    """Forward FLOPs."""
    bytes: float
    """Forward bytes read and written."""
    backward: float = 2.0
    """What the backward costs, in forwards."""
    kept: bool = True
    """Its output is kept under torchtitan's per-op checkpointing (else recomputed)."""
    head_dim: int = 0
    """Attention only: the kernel's rate depends on it and on `length`."""
    length: int = 0
    """Attention only: keys per kernel call (s, or s/cp per hop of ring attention)."""


def _kv(model: ModelConfig) -> int:
    return model.n_kv_heads * model.head_dim


def _matmul(name: str, tokens: int, k: int, n: int, precision: str, kept: bool) -> list[Op]:
    e = ELEM[precision]
    # T·K·N multiply-adds, 2 FLOPs each
    flops = 2.0 * tokens * k * n
    if not numerics(precision).fp8:
        return [Op(name, "matmul", flops, e * (tokens * k + k * n + tokens * n), kept=kept)]
    # operands in fp8, output in bf16; the casts are memory-bound ops of their own
    casts = (2 * e + 1) * (tokens * k + k * n)
    backward_casts = (2 * e + 1) * tokens * n + 2 * (tokens * k + tokens * n)
    return [
        Op(name, "fp8-matmul", flops, tokens * k + k * n + e * tokens * n, kept=kept),
        Op(name + " fp8 casts", "memory", casts, casts, backward=backward_casts / casts, kept=False),
    ]


def representative_block(model: ModelConfig) -> str:
    """The name prefix of the block that stands for every block in the planner's closed forms: block 0,
    or with dense first layers (DeepSeek-V3's first_k_dense_replace) the first MoE block: they are the
    many (58 of DeepSeek-V3's 61). The dense ones are priced as MoE blocks in time; their parameters are
    counted as theirs (stages.py `stage_params`)."""
    return f"blocks.{model.dense_layers}." if model.experts and model.dense_layers < model.layers else "blocks.0."


@lru_cache(maxsize=4096)
def block_ops(model: ModelConfig, tp: int, cp: int, sp: bool, b: int, precision: str) -> tuple[Op, ...]:
    """One transformer block's forward on one rank, for a microbatch of b sequences."""
    e = ELEM[precision]
    s = model.seq // cp
    tokens, rows = b * s, b * s // (tp if sp else 1)  # rows: what the norms and residuals see
    h, f, a = model.hidden, model.expert_ffn if model.experts else model.ffn, model.heads
    fam = model.family
    ops: list[Op] = []
    index = 0  # torchtitan's op policy keeps the 1st, 3rd, ... matmul of a block
    first = representative_block(model)
    for name, shape in param_shapes(model):
        # one block stands for every block; vectors are the memory ops below; the router goes with the experts
        if not name.startswith(first) or len(shape) != 2 or name.endswith("router.weight"):
            continue
        n, k = shape  # nn.Linear's (out, in)
        module = name[len(first) : -len(".weight")]
        # row-parallel layers split their input features, column-parallel ones their output features;
        # MLA's latent down-projections stay whole; the shared experts are replicated over tp with
        # their MoE layer (layout/tensor.py)
        if not module.startswith("mlp.shared."):
            n, k = (n, k // tp) if module in ROWWISE else (n, k) if module in LATENT else (n // tp, k)
        ops += _matmul(module, tokens, k, n, precision, kept=index % 2 == 0)
        index += 1
    if model.experts:  # dropless top-k: this rank's experts see T·k rows in all (balanced routing)
        routed = tokens * model.top_k
        mats = 3 if fam.gated_mlp else 2
        ops += _matmul("mlp.router", tokens, h, model.experts, precision, kept=False)
        for i in range(mats):
            k, n = (f, h) if i == mats - 1 else (h, f)
            ops += _matmul(f"mlp.experts.{i}", routed, k, n, precision, kept=False)
        ops.append(Op("moe gather/scatter", "memory", 0, 4 * e * routed * h, kept=False))
    hd, q = model.head_dim, a * model.head_dim  # h // a and h unless kv_channels sets head_dim apart
    attn_flops = 4.0 * b * s * model.seq * (a // tp) * hd / 2  # causal: half the products
    if any(model.layer_window(i) for i in range(model.layers)):  # Gemma 3: its local layers' pairs only
        attn_flops = 4.0 * b * (a // tp) * hd * _mean_pairs(model) / cp
    # the kernel reads q, k, v and writes its output once: q and the output h/t wide, k and v kv/t
    attn_bytes = e * tokens * (2 * q + 2 * _kv(model)) / tp
    if fam.latent_attention:  # MLA: q·k over dn + dr, p·v over dv; the kernel runs q, k, v, out at W
        hd = kernel_width(model)
        attn_flops = 2.0 * b * s * model.seq * (a // tp) * (model.qk_nope_head_dim + model.qk_rope_head_dim)
        attn_flops = (attn_flops + 2.0 * b * s * model.seq * (a // tp) * model.v_head_dim) / 2  # causal
        attn_bytes = e * tokens * 4 * (a // tp) * hd
    ops.append(Op("attention", "attention", attn_flops, attn_bytes, backward=2.5, head_dim=hd, length=s))
    # eager kernels, bytes per element forward / backward (each reads its inputs and writes its
    # output once; DERIVATIONS.md, "The time model", counts them kernel by kernel):
    #   RMSNorm upcast as torch and torchtitan write it (x.float(), x², mean, x·rsqrt, .type_as,
    #   ·weight) 28 + 4e / 52 + 6e; LayerNorm (fused) 2e / 5e; residual add 3e / 3e; RoPE through
    #   complex fp32, on q and k, 16 + 2e / 16 + 2e; k and v repeated to every head (GQA,
    #   torchtitan's repeat_kv) e·(kv + h) each way; the attention output's transpose back to
    #   (b, s, h) 2e each way; GELU 2e / 3e; SwiGLU silu(gate)·up 5e / 9e
    norm, norm_back = (28 + 4 * e, 52 + 6 * e) if model.norms.rms else (2 * e, 5 * e)
    ops.append(Op("norms", "memory", 0, 2 * norm * rows * h, backward=norm_back / norm, kept=False))
    ops.append(Op("residual adds", "memory", 0, 2 * 3 * e * rows * h, backward=1.0, kept=False))
    kv = _kv(model)
    if fam.rotary:
        ops.append(Op("rope", "memory", 0, (2 * e + 16) * tokens * (h + kv) / tp, backward=1.0, kept=False))
    # the output's transpose back to (b, s, h); GQA's repeat of k and v only where kv < h
    layout = 2 * e * tokens * h / tp + (2 * e * tokens * (kv + h) / tp if kv < h else 0)
    ops.append(Op("attention layout", "memory", 0, layout, backward=1.0, kept=False))
    if not model.experts:
        act, act_back = (5 * e, 9 * e) if fam.gated_mlp else (2 * e, 3 * e)
        ops.append(Op("activation", "memory", 0, act * tokens * f / tp, backward=act_back / act, kept=False))
    return tuple(ops)


LOSS_FORWARD = 4 + 12
"""Bytes per logit of the loss forward beyond the compute-dtype logits: the cast to fp32 (write 4)
and log_softmax (read twice, write once, fp32). Its backward: nll's dense gradient (write 4),
log_softmax's backward (read 8, write 4), the cast back (read 4): 20 + e."""


def _loss_op(model: ModelConfig, e: int, logits: int) -> Op:
    """The cross-entropy's passes over the logits: LOSS_FORWARD's, or a fused kernel's (loss='fused':
    flash-attn's, which reads the logits once forward and reads them and writes the gradient
    backward, e bytes each)."""
    if model.fused_loss:
        return Op("loss", "memory", 0, e * logits, backward=2.0)
    return Op("loss", "memory", 0, (e + LOSS_FORWARD) * logits, backward=(20 + e) / (e + LOSS_FORWARD))


@lru_cache(maxsize=4096)
def head_ops(model: ModelConfig, tp: int, cp: int, sp: bool, b: int, precision: str) -> tuple[Op, ...]:
    """The final norm, the LM head (vocab-parallel over tp) and the cross-entropy (ModelConfig.loss)."""
    e = ELEM[precision]
    tokens = b * model.seq // cp
    rows = tokens // (tp if sp else 1)
    h, v = model.hidden, model.vocab // tp
    norm = 20 + 4 * e if model.norms.rms else 2 * e
    logits = tokens * v
    return (
        Op("head norm", "memory", 0, norm * rows * h),
        *_matmul("lm head", tokens, h, v, precision, kept=True),
        _loss_op(model, e, logits),
    )


@lru_cache(maxsize=4096)
def embed_ops(model: ModelConfig, tp: int, cp: int, sp: bool, b: int, precision: str) -> tuple[Op, ...]:
    """The token lookup (and the position table's add, gpt): forward reads and writes the rows;
    backward zeroes the table's gradient and adds the rows in."""
    e = ELEM[precision]
    tokens = b * model.seq // cp
    table = model.vocab // tp * model.hidden
    fwd = 3 * e * tokens * model.hidden
    return (Op("embedding", "memory", 0, fwd, backward=(4 * table + 2 * e * tokens * model.hidden) / fwd),)


OPTIMIZER_BYTES = 40
"""Bytes per parameter element of AdamW + clipping on the rank's (sharded) fp32 states: read
master, gradient, both moments and write master and moments (28), the norm's read of the gradient
and the clip's scaling in place (12)."""


def _mean_pairs(model: ModelConfig) -> float:
    """(query, key) pairs a block computes, averaged over the blocks: s²/2 causal (a global layer, as
    the formula above halves it), s·w - w(w-1)/2 for a window of w (each query its last w keys)."""
    s = model.seq
    pairs = [s * s / 2 if w is None else s * w - w * (w - 1) / 2 for w in map(model.layer_window, range(model.layers))]
    return sum(pairs) / len(pairs)


@lru_cache(maxsize=256)
def model_flops_per_token(model: ModelConfig) -> float:
    """Model FLOPs per token of forward + backward, PaLM's convention (Chowdhery et al. 2022,
    appendix B; torchtitan and MFU tables use it): 6·N + 12·L·h·s, N the parameters a token
    passes through without the embedding table (the LM head counted, a tied one too), and the
    attention products counted whole (not halved for the causal mask), h = heads·head_dim, a
    sliding-window layer's at its window's w keys instead of s."""
    total = 0.0
    for name, shape in param_shapes(model):
        # the embedding table is a lookup, not a product: PaLM leaves it out
        if name.startswith("embed."):
            continue
        n = prod(shape)
        if is_expert(name):
            # a token passes through top_k of the E experts
            n = n * model.top_k / model.experts
        total += n
    if model.tied:
        total += model.vocab * model.hidden  # the head's product with the tied table
    q = model.heads * model.head_dim  # = h unless kv_channels (torchtitan's 12·l·heads·head_dim·s)
    if not any(model.layer_window(i) for i in range(model.layers)):
        return 6.0 * total + 12.0 * model.layers * q * model.seq
    # a sliding-window layer's queries see w keys, not s (Gemma 3: five layers in six)
    keys = sum(model.seq if w is None else w for w in map(model.layer_window, range(model.layers)))
    return 6.0 * total + 12.0 * q * keys
