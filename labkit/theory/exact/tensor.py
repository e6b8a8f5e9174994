"""Tensor and sequence parallelism, predicted (our implementation, engines/parallel/tensor/):
activations saved for backward and the tp collectives per step (Shoeybi et al. 2019;
Korthikanti et al. 2022). Which parameters a tp rank holds is the styles' (layout/tensor.py,
read by theory/exact/params.py). Per block and microbatch, with s' = s/t under SP (else s), for the gpt
family with multi-head attention:
    activations  act·(2bs'h + 2bsh + 4bsh/t + 2bsf/t + 4bs') + 4(a/t)bs
    comm         TP: 4L + 2 all-reduces of B = act·b·s·h; SP: as many all-gathers and
                 reduce-scatters of B, which cost on the wire what the all-reduce does
                 (+ tp > kv_heads: the shared KV heads' gradient sums, `shared_kv`)
What each term is, the llama family, GQA, MoE layers (replicated over tp), pipelines and
recomputation: DERIVATIONS.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.precision import ELEM, REDUCE
from labkit.theory.exact import float8, latent
from labkit.theory.exact.batch import microbatch_rows
from labkit.theory.exact.experts import layer_activation_bytes, moe_layers_held
from labkit.theory.exact.memory import gemma_norm_bytes, qk_norm_bytes, rotary_bytes
from labkit.theory.exact.pipeline import stage_layers


def activation_bytes(
    model: ModelConfig,
    batch: int,
    tp: int,
    sp: bool = False,
    seq: int | None = None,
    act_bytes: int = 4,
    megatron_regather: bool = False,
    head: bool = True,
    embed: bool = True,
    tables: int | None = None,
) -> int:
    """Bytes our TP (+ SP) model saves for backward for one microbatch of `batch` rows on one
    rank (DERIVATIONS.md counts them): model.layers blocks, plus the head and the embedding if
    asked. seq: the rank's sequence (default the model's; s/cp under CP). megatron_regather: count the
    column-parallel inputs as s/t shards, as Megatron keeps them. llama's RMSNorms keep their
    input, rstd and normalised input in fp32 (memory.activation_bytes); k and v are the rank's
    KV heads (kv_heads/tp of them, or the one it shares when tp > kv_heads)."""
    b, h, f, a, v, e = batch, model.hidden, model.ffn, model.heads, model.vocab, act_bytes
    s = seq or model.seq
    rows = s // tp if sp else s  # residual-stream rows this rank holds
    kept = rows if megatron_regather else s  # rows of the column-parallel inputs kept
    kv = max(1, model.n_kv_heads // tp) * model.head_dim  # width of the rank's k (and v)
    fam = model.family
    if model.experts:
        mlp = layer_activation_bytes(model, b, s, e)
    else:
        mlp = e * (4 if fam.gated_mlp else 2) * b * s * f // tp
    q = model.heads * model.head_dim  # h unless kv_channels sets head_dim apart
    attn = e * (2 * b * s * q // tp + 2 * b * s * kv)  # q and the attention output of the local heads; k, v
    attn += qk_norm_bytes(model, b, s, a // tp, max(1, model.n_kv_heads // tp))  # on the gathered sequence
    # the two norms: RMSNorm keeps fp32 statistics and inputs, LayerNorm its input and two statistics
    norms = 8 * (2 * b * rows * h + b * rows) if model.norms.rms else e * (2 * b * rows * h + 4 * b * rows)
    block = norms + e * 2 * b * kept * h + attn + mlp
    block += gemma_norm_bytes(model, b, rows, s)  # Gemma's post-sublayer norms on the stream's rows
    block += 4 * (a // tp) * b * s
    if fam.latent_attention:  # MLA in place of q, k, v, the output and the lse (theory/exact/latent.py)
        block += latent.attention_bytes(model, b, s, tp, e) - attn - 4 * (a // tp) * b * s
    total = model.layers * block
    if fam.rotary and model.layers:
        total += rotary_bytes(model, s, e, tables)  # the rotary tables, on the gathered sequence
    if head:
        norm = 4 * (2 * b * rows * h + b * rows) if model.norms.rms else e * (b * rows * h + 2 * b * rows)
        norm += 4 * h if fam.offset_norm else 0  # Gemma's (1 + w)
        # the loss keeps the fp32 softmax ('fp32') or the logits and the fp32 log-sum-exp ('fused'),
        # with the local targets (int64) and whether another rank holds them (bool)
        loss = e * b * s * v // tp + 4 * b * s if model.fused_loss else 4 * b * s * v // tp
        total += norm + e * b * kept * h + loss + 8 * b * s + b * s
    if embed:
        total += 8 * b * s + b * s + (0 if fam.rotary else 8 * s)
        total += e if fam.scaled_embedding else 0  # Gemma's sqrt(h), a 0-dim tensor
    return total


def collectives(cfg: ParallelConfig, model: ModelConfig, pp_rank: int = 0) -> list[tuple[str, int, int, str]]:
    """(op, payload bytes, calls per step, what) of every tp collective a rank at pipeline
    coordinate `pp_rank` issues per step (DERIVATIONS.md counts them)."""
    if cfg.tp == 1:
        return []
    m = cfg.microbatches
    L, first, last = stage_layers(cfg, model, pp_rank)
    ends = int(first) + int(last)  # the embedding's and the head's
    again = 2 if cfg.recomputation.reruns_forward else 1  # recomputation repeats a block's forward
    b = microbatch_rows(cfg)
    B = ELEM[cfg.precision] * b * (model.seq // cfg.cp) * model.hidden
    moe = moe_layers_held(cfg, model, pp_rank)  # an MoE layer (replicated over tp) has no g of its own
    fp8 = float8.tp_layers(cfg, model)  # fp8 (tensorwise): the layers whose split operands agree on an amax
    if cfg.sequence_parallel:  # per layer forward (+ backward): attention AG, RS (+ RS, AG); MLP the same,
        gather = L * (2 * again + 2) + ends  # MoE AG (+ AG of its output's gradient)
        scatter = (2 * L - moe) * (again + 1) + ends
        in_fp8 = L * fp8["gathered"] * again  # fp8: the forward's gathers into column-parallel regions, 1 byte
        rows = [
            ("all_gather", B, (gather - in_fp8) * m, "into column-parallel / MoE regions (fwd), out of row-parallel"),
            ("all_gather", B // ELEM[cfg.precision], in_fp8 * m, "fp8: into column-parallel regions, cast first"),
            ("reduce_scatter", B, scatter * m, "out of row-parallel regions (fwd), into column-parallel (bwd)"),
        ]
    else:  # per layer: g after wo (and fc2) forward, f before attention (and MLP) backward
        reduce = (2 * L - moe) * (again + 1) + ends
        rows = [("all_reduce", B, reduce * m, "g after row-parallel layers (fwd), f before column-parallel (bwd)")]
    if last:
        s = model.seq // cfg.cp
        rows += [
            ("all_reduce", 4 * b * s, m, "vocab-parallel loss: max logit"),
            ("all_reduce", 8 * b * s, m, "vocab-parallel loss: sum of exponentials, target logit"),
        ]
    if fp8["rowwise"] or fp8["colwise"]:  # theory/exact/float8.py: the amaxes, fp32 each
        rows += [
            ("all_reduce", float8.AMAX * float8.tp_weight_amaxes(cfg, model, L), 1, "fp8: the split weights' amaxes"),
            ("all_reduce", float8.AMAX, L * sum(fp8.values()) * m, "fp8: a split input's, output gradient's amax"),
        ]
    # the squared gradient norm's all-reduce is theory/exact/sharding.py grad_norm (over every splitting dim)
    return rows


def shared_kv(cfg: ParallelConfig, model: ModelConfig, pp_rank: int = 0) -> list[tuple[str, int, int, int]]:
    """(op, payload bytes, calls per step, group size) of the gradient sums of KV heads shared by
    k = tp/kv_heads ranks (tp > kv_heads): per layer and microbatch, in backward, wk's and wv's
    (head_dim, h) gradient slices — and their biases (gpt2, GPT-OSS, Qwen2) — all-reduced in fp32 over the
    k ranks that hold the head (engines/parallel/tensor/ops.py ReduceGrad)."""
    kv = model.n_kv_heads
    if cfg.tp <= kv:
        return []
    k = cfg.tp // kv
    calls = stage_layers(cfg, model, pp_rank)[0] * cfg.microbatches
    out = [("all_reduce", REDUCE * model.head_dim * model.hidden, 2 * calls, k)]
    if model.family.biases or model.family.attention_biases or model.qkv_bias:  # gpt2, GPT-OSS, Qwen2
        out.append(("all_reduce", REDUCE * model.head_dim, 2 * calls, k))
    return out


def per_layer(cfg: ParallelConfig, model: ModelConfig) -> dict[str, int]:
    """Payload bytes one transformer layer moves per microbatch, per op (forward + backward)."""
    B = ELEM[cfg.precision] * microbatch_rows(cfg) * (model.seq // cfg.cp) * model.hidden
    if cfg.sequence_parallel:
        return {"all_gather": 4 * B, "reduce_scatter": 4 * B}
    return {"all_reduce": 4 * B}


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Add every rank's tp collectives (one step) to `comm` (a theory/exact/comm.py Comm)."""
    if cfg.tp == 1:
        return
    label = layout.label("tp")
    for rank in comm.ranks(layout):
        pp_rank = layout.coords(rank)["pp"]
        for op, payload, calls, _ in collectives(cfg, model, pp_rank):
            comm.add(rank, label, op, payload, cfg.tp, calls)
        for op, payload, calls, n in shared_kv(cfg, model, pp_rank):
            comm.add(rank, label, op, payload, n, calls)
