"""Tensor and sequence parallelism, predicted: parameters per rank, activations saved for
backward, and wire bytes per collective (labkit's implementation, engines/parallel/tensor.py).

Parameters: the plan (labkit/plans/tensor.py, the same table the engines execute)
splits every weight matrix, the token table and the LM head over tp; LayerNorms and the
position embedding stay whole on every rank.

Activations, counted from what our model saves (exact; the meter agrees to the byte). With
t = tp, b the microbatch, s the sequence, s' = s/t under SP and s otherwise (the rows of the
residual stream a rank holds), per block, act bytes per element:
    2bs'h      LayerNorm inputs (the residual stream)
    2bsh       LayerNorm outputs, replicated / all-gathered, kept by the column-parallel layers
               (Megatron keeps the s/t shard and all-gathers it again in backward: 2bs'h)
    4bsh/t     q, k, v and the attention output of the local heads
    2bsf/t     fc1 output and GELU output
  + 4bs' (LayerNorm mean and rstd, two LayerNorms; in the activation dtype on the CPU)
  + 4(a/t)bs (attention log-sum-exp, fp32)
head: bs'h + bsh (norm input, gathered output) + 2bs' (stats) + 4bsV/t (fp32 softmax of the
vocab-parallel loss) + 8bs (local target ids) + bs (bool: target on another rank)
embedding: 8bs (local token ids) + bs (bool mask) + 8s (positions).
An MoE layer is replicated over tp (plans/tensor.py): in place of the 2bsf/t it keeps what
experts.layer_activation_bytes lists for all s tokens (its input is the LayerNorm output
above, gathered under SP).
Korthikanti et al. (2022), table 2 count a different block (dropout, stored softmax): sbh(10 +
24/t + 5as/(ht)) with TP, sbh(34/t + 5as/(ht)) with TP + SP (theory.korthikanti_layer_bytes);
the shape of the saving is the same: only the tensors between the parallel regions shrink.

Communication per microbatch, B = act·b·s·h (s: the rank's sequence, s/cp under CP), L layers,
all over the tp group:
  TP    all-reduce B: forward 1 (embedding) + 2L (wo, fc2), backward 2L (attention and MLP
        inputs: f) + 1 (LM head input)                                     -> 4L + 2 of B
  SP    the same sums as reduce-scatter + all-gather pairs: all-gather B 2L + 1 forward,
        2L + 1 backward; reduce-scatter B likewise                         -> 4L + 2 of each
  MoE   a replicated MoE layer needs no f and no g: 2 all-reduces per layer (attention's)
        instead of 4; under SP its input is all-gathered forward and its output's gradient
        backward (2 all-gathers, no reduce-scatter): all-gather 4L + 2, reduce-scatter 2L + 2
  loss  all-reduce 4bs (max) and 8bs (sum-exp, target logit), fp32, forward only
With a pipeline a rank counts the L of its own chunks, the embedding's 1 + 1 only on the first
stage and the head's (and the loss's) only on the last. With checkpoint_activations each
block's forward runs again in backward, and so do its forward collectives.
and per step: one all-reduce of the squared gradient norm (4 bytes) over tp; under SP the
LayerNorm and position-embedding gradients join DDP's buckets over tp (x dp, ep, cp).
Ring model: all-reduce 2(t-1)/t·B sent per rank, all-gather / reduce-scatter (t-1)/t·B, so
SP's pair of collectives costs what the all-reduce it replaces costs.
"""
from __future__ import annotations

from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.mesh import DATA_DIMS
from labkit.plans.tensor import local_param, tp_plan
from labkit.theory.model import param_shapes


def rank_params(cfg: ParallelConfig, model: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(name, shape this rank holds, mesh dims its gradient is summed over) of every parameter,
    in registration order (the same on every tp rank: the split is even)."""
    if cfg.tp == 1:
        return [(n, s, DATA_DIMS) for n, s in param_shapes(model)]
    plan = tp_plan(model, cfg.sequence_parallel)
    out = []
    for name, shape in param_shapes(model):
        local, _, extra, _ = local_param(plan, name, shape, cfg.tp)
        out.append((name, local, DATA_DIMS + extra))
    return out


def rank_param_count(cfg: ParallelConfig, model: ModelConfig) -> int:
    """Parameters one rank holds (Ψ/t for the split matrices, whole LayerNorms and positions)."""
    return sum(prod(s) for _, s, _ in rank_params(cfg, model))


def activation_bytes(model: ModelConfig, batch: int, tp: int, sp: bool = False, seq: int | None = None,
                     act_bytes: int = 4, megatron_regather: bool = False, head: bool = True,
                     embed: bool = True) -> int:
    """Bytes our TP (+ SP) model saves for backward for one microbatch of `batch` rows on one
    rank (module docstring): model.layers blocks, plus the head and the embedding if asked.
    seq: the rank's sequence (default the model's; s/cp under CP). megatron_regather: count the
    column-parallel inputs as s/t shards, as Megatron keeps them."""
    from labkit.theory.experts import layer_activation_bytes

    b, h, f, a, v = batch, model.hidden, model.ffn, model.heads, model.vocab
    s = seq or model.seq
    rows = s // tp if sp else s                       # residual-stream rows this rank holds
    kept = rows if megatron_regather else s           # rows of the column-parallel inputs kept
    mlp = layer_activation_bytes(model, b, s, act_bytes) if model.experts else act_bytes * 2 * b * s * f // tp
    block = act_bytes * (2 * b * rows * h + 2 * b * kept * h + 4 * b * s * h // tp + 4 * b * rows) + mlp
    block += 4 * (a // tp) * b * s
    total = model.layers * block
    if head:
        total += act_bytes * (b * rows * h + b * kept * h + 2 * b * rows) + 4 * b * s * v // tp + 8 * b * s + b * s
    if embed:
        total += 8 * b * s + b * s + 8 * s
    return total


def collectives(cfg: ParallelConfig, model: ModelConfig, pp_rank: int = 0) -> list[tuple[str, int, int, str]]:
    """(op, payload bytes, calls per step, what) of every tp collective a rank at pipeline
    coordinate `pp_rank` issues per step (module docstring)."""
    from labkit.theory.params import stage_layers

    if cfg.tp == 1:
        return []
    m = cfg.microbatches
    L, first, last = stage_layers(cfg, model, pp_rank)
    ends = int(first) + int(last)                         # the embedding's and the head's
    again = 2 if cfg.checkpoint_activations else 1        # recomputation repeats a block's forward
    b = cfg.global_batch // (cfg.dp * cfg.ep * m)
    s = model.seq // cfg.cp
    act = 2 if cfg.precision == "bf16" else 4
    B = act * b * s * model.hidden
    moe = bool(model.experts)
    if cfg.sequence_parallel:   # per layer forward (+ backward): attention AG, RS (+ RS, AG); MLP the same,
        gather = L * (2 * again + 2) + ends                   # MoE AG (+ AG of its output's gradient)
        scatter = L * ((1 if moe else 2) * (again + 1)) + ends
        rows = [("all_gather", B, gather * m, "into column-parallel / MoE regions (fwd), out of row-parallel (bwd)"),
                ("reduce_scatter", B, scatter * m, "out of row-parallel regions (fwd), into column-parallel (bwd)")]
    else:                       # per layer: g after wo (and fc2) forward, f before attention (and MLP) backward
        reduce = L * ((1 if moe else 2) * (again + 1)) + ends
        rows = [("all_reduce", B, reduce * m, "g after row-parallel layers (fwd), f before column-parallel (bwd)")]
    if last:
        rows += [("all_reduce", 4 * b * s, m, "vocab-parallel loss: max logit"),
                 ("all_reduce", 8 * b * s, m, "vocab-parallel loss: sum of exponentials, target logit")]
    # the squared gradient norm's all-reduce is theory/comm.py grad_norm (over every splitting dim)
    return rows


def per_layer(cfg: ParallelConfig, model: ModelConfig) -> dict[str, int]:
    """Payload bytes one transformer layer moves per microbatch, per op (forward + backward)."""
    b = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
    B = (2 if cfg.precision == "bf16" else 4) * b * (model.seq // cfg.cp) * model.hidden
    if cfg.sequence_parallel:
        return {"all_gather": 4 * B, "reduce_scatter": 4 * B}
    return {"all_reduce": 4 * B}


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Add every rank's tp collectives (one step) to `comm` (theory/comm.py's Comm)."""
    if cfg.tp == 1:
        return
    label = layout.label("tp")
    for rank in comm.ranks(layout):
        for op, payload, calls, _ in collectives(cfg, model, layout.coords(rank)["pp"]):
            comm.add(rank, label, op, payload, cfg.tp, calls)
