"""Tensor parallelism (Megatron-LM) and sequence parallelism, labkit's own.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3: split each MLP's first weight by columns and its second by
rows, so the GELU between them needs no communication; split attention by heads (wq, wk, wv
column-parallel, wo row-parallel). Two conjugate operators join the pieces: f (identity
forward, all-reduce backward) where a replicated activation enters a parallel region, g
(all-reduce forward, identity backward) where the partial outputs leave it: per layer two
all-reduces of (b, s, h) forward and two backward. The embedding and the LM head are split
along the vocabulary; the cross-entropy runs on the logit shards (the (b, s, V) logits are
never gathered).

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
section 4.2.2: between the parallel regions (LayerNorms, residual adds; dropout elsewhere)
every rank repeats the same work on the same (b, s, h) tensor. Sequence parallelism shards
those regions along the sequence: g becomes an all-gather along the sequence (forward;
reduce-scatter backward) and the closing all-reduce becomes a reduce-scatter (forward;
all-gather backward). An all-reduce is a reduce-scatter plus an all-gather, so the bytes are
the same; the LayerNorm inputs and the residual stream shrink to s/t rows.

Where this differs from Megatron: wq, wk and wv stay separate Linear layers (Megatron fuses
them), so the input operator sits once at the input of the attention / MLP (a forward
pre-hook named in the styles), not inside each linear layer. And under SP the column-parallel
layers keep their gathered input for backward; Megatron keeps the s/t shard and all-gathers
it again in backward, trading two more all-gathers per layer for 2bsh(1 - 1/t) bytes
(labkit/theory/exact/tensor.py gives both).

MoE layers are replicated over tp (DERIVATIONS.md says why): no f or g around them, and under
SP an all-gather in (`GatherReplicated`) and a slice out (`Split`). Biases (gpt2, Qwen2's q, k,
v): a column-parallel bias is split with its rows, a row-parallel one added once, after the
sum. Grouped-query attention: wk and wv split by KV heads when tp <= kv_heads; when tp >
kv_heads each KV head is held by the tp/kv_heads ranks that read it (`SharedKVLinear`).

Under fp8 (tensorwise) the layers the styles mark "fp8" are engines/float8.py's Float8Linear or a
RowParallelLinear computing in fp8, as torchtitan's float8 TP plan (torchao's Float8ColwiseParallel,
Float8RowwiseParallel) has them: an operand split over tp takes its amax over tp (a rowwise layer's
input, a colwise layer's output gradient; each weight's once per step, `WeightScales`), so every
rank casts with the one-process model's scales; under SP their modules gather their input in fp8.

The operators are in engines/parallel/tensor/ops.py; the styles (layout/tensor.py) are data;
`apply_tp` walks it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.config.choices import fused_loss
from labkit.engines.float8 import Float8Linear, Operands, WeightScales, float8_linear
from labkit.engines.layers import scaled
from labkit.engines.loss import mask_padding
from labkit.engines.parallel.common import ParamMetas
from labkit.engines.parallel.tensor.ops import (
    Copy,
    Gather,
    GatherFloat8,
    GatherReplicated,
    Reduce,
    ReduceGrad,
    Scatter,
    Split,
    VocabParallelCrossEntropy,
)
from labkit.layout.mesh import DATA_DIMS
from labkit.layout.tensor import local_param, param_style, tp_styles


# -- the parallel modules -------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """Y = sum_i X_i B_i (+ b): input features split over tp; `leave` sums the partial products
    (all-reduce, or reduce-scatter along the sequence under SP); the bias, replicated, is added
    once, after the sum (to this rank's s/t rows under SP). `ops`: in fp8 (engines/float8.py)."""

    def __init__(self, weight: torch.Tensor, leave, bias: torch.Tensor | None = None, ops: Operands | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.leave, self.ops = leave, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (b, s, in/t) -> (b, s, out) partial -> summed
        y = F.linear(x, self.weight) if self.ops is None else float8_linear(x, self.weight, self.ops)
        y = self.leave(y)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class SharedKVLinear(nn.Module):
    """wk or wv when tp > kv_heads: this rank's one KV head, also held by the other ranks of
    `group` (the tp ranks whose query heads read it); its gradient is summed over them (ReduceGrad)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else ReduceGrad.apply(self.bias, self.group)
        return F.linear(x, ReduceGrad.apply(self.weight, self.group), bias)  # (b, s, h) -> (b, s, hd)


class VocabParallelEmbedding(nn.Module):
    """Token table split along the vocabulary (rows [start, start + V/t)), plus the replicated
    position embedding (gpt, gpt2). Tokens another rank owns look up zeros; `leave` sums the
    partial lookups. Under SP the sum lands sequence-sharded and each rank adds its s/t positions."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding | None, start: int, leave, seq_chunk=None, scale=None):
        super().__init__()
        self.tok, self.pos, self.start, self.leave = tok, pos, start, leave
        self.seq_chunk = seq_chunk  # (tp rank, tp) under SP, else None
        self.scale = scale  # Gemma's sqrt(h) (engines/model.py Embedding), else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        v = self.tok.weight.shape[0]
        outside = (tokens < self.start) | (tokens >= self.start + v)  # (b, s)
        x = F.embedding((tokens - self.start).masked_fill(outside, 0), self.tok.weight)  # (b, s, h)
        x = self.leave(x.masked_fill(outside[..., None], 0.0))  # (b, s, h) partial -> summed (or s/t rows)
        x = scaled(x, self.scale)
        if self.pos is None:
            return x
        if self.seq_chunk is not None:
            r, t = self.seq_chunk
            positions = positions.reshape(t, -1)[r]  # (s,) -> (s/t,) this rank's rows
        return x + self.pos(positions)


class VocabParallelHead(nn.Module):
    """Final norm, the LM head split along the vocabulary, and the vocab-parallel loss. Rows of a
    padded vocabulary at or beyond `vocab` (on the last tp ranks) are masked out of the loss."""

    def __init__(self, norm: nn.Module, proj: nn.Linear, start: int, enter, group, loss: str, vocab: int):
        super().__init__()
        self.norm, self.proj, self.start, self.enter, self.group = norm, proj, start, enter, group
        self.loss, self.fused = loss, fused_loss(loss)
        self.valid = min(max(vocab - start, 0), proj.weight.shape[0])  # this rank's rows that are tokens

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.enter(self.norm(x))  # (b, s, h) on every tp rank
        logits = mask_padding(self.proj(x), self.valid)  # (b, s, h) -> (b, s, V/t)
        logits = logits if self.fused else logits.float()  # ModelConfig.loss
        return VocabParallelCrossEntropy.apply(
            logits.flatten(0, 1), targets.flatten(), self.start, self.group, self.fused
        )


# -- applying the styles -------------------------------------------------------------------
def _sliced(weight: torch.Tensor, box) -> nn.Parameter:
    """This rank's slice of a full (seeded) weight, as a parameter with storage of its own."""
    return nn.Parameter(weight.detach()[tuple(slice(a, b) for a, b in box)].clone())


def apply_tp(
    model: nn.Module, mesh, metas: ParamMetas, *, sequence_parallel: bool, float8: WeightScales | None = None
) -> tuple[nn.Module, dict]:
    """Slice the full, seeded `model` for this tp rank as the styles say (on the mesh's tp group);
    returns (model, the styles as data for the report). `float8`: the model's fp8 layers (tensorwise)
    keep their split weights' scales there.

    In `metas`, sliced parameters get `full_shape` / `box`; replicated ones `replicas=('tp',)`,
    and under SP `reduce` gains 'tp' (each rank saw s/t positions: partial gradients). A KV
    head shared by k = tp/kv_heads ranks is counted in the norm on one of them (`tp_share = k`)."""
    group, t, r = mesh.group("tp"), mesh.size("tp"), mesh.coord("tp")
    styles = tp_styles(model.cfg, sequence_parallel, t, fp8=float8 is not None)
    fp8_mm = next((m.ops.mm for m in model.modules() if isinstance(m, Float8Linear)), None)  # their one config
    ops = {
        "copy": lambda x: Copy.apply(x, group),
        "all-gather": lambda x: Gather.apply(x, group),
        "all-gather-fp8": lambda x: GatherFloat8.apply(x, group, fp8_mm),
        "all-reduce": lambda x: Reduce.apply(x, group),
        "reduce-scatter": lambda x: Scatter.apply(x, group),
        "all-gather-replicated": lambda x: GatherReplicated.apply(x, group),
        "split": lambda x: Split.apply(x, group),
    }
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}

    for name, style in styles.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr)
        kind = style["style"]
        if "shard_dim" in style:
            _, box, _, _ = local_param(styles, name + ".weight", tuple(module.weight.shape), t, r)
            weight = _sliced(module.weight, box)
            bias = getattr(module, "bias", None)
            if bias is not None and kind == "colwise":  # split with the rows
                bias = _sliced(bias, local_param(styles, name + ".bias", tuple(bias.shape), t, r)[1])
        if kind == "colwise" and "kv_groups" in style:
            share = mesh.run_group("tp", t // style["kv_groups"])
            setattr(parent, attr, SharedKVLinear(weight, bias, share))
        elif kind == "colwise":
            module.weight, module.bias, module.out_features = weight, bias, weight.shape[0]
            if style.get("fp8"):  # the output's features split: its gradient's amax over tp
                module.ops.grad_group = group
                module.ops.weight_scale, module.ops.scales = float8.track(module.weight, group), float8
        elif kind == "rowwise":
            f8 = None
            if style.get("fp8"):  # the input's features split: its amax over tp
                f8 = Operands(mm=module.ops.mm, input_group=group, scales=float8)
            row = RowParallelLinear(weight, ops[style["output"]], bias, f8)
            if f8 is not None:
                f8.weight_scale = float8.track(row.weight, group)
            setattr(parent, attr, row)
        elif kind == "vocab" and isinstance(module, nn.Embedding):
            module.weight, module.num_embeddings = weight, weight.shape[0]
            sp = styles.get(parent_name + ".pos", {}).get("style") == "sequence"
            model.set_submodule(
                parent_name,
                VocabParallelEmbedding(
                    module, parent.pos, box[0][0], ops[style["output"]], (r, t) if sp else None, parent.scale
                ),
            )
        elif kind == "vocab":
            module.weight, module.out_features = weight, weight.shape[0]
            if "tied" in style:  # the embedding's slice, one Parameter for both ends
                module.weight = model.get_submodule(style["tied"]).weight
            model.set_submodule(
                parent_name,
                VocabParallelHead(
                    parent.norm, module, box[0][0], ops[style["input"]], group, parent.loss, parent.vocab
                ),
            )
        elif kind == "input":
            enter = ops[style["input"]]
            module.register_forward_pre_hook(lambda _m, args, enter=enter: (enter(args[0]), *args[1:]))
        elif kind == "replicate" and "input" in style:  # an MoE layer under SP (layout/tensor.py)
            enter, leave = ops[style["input"]], ops[style["output"]]
            module.register_forward_pre_hook(lambda _m, args, enter=enter: (enter(args[0]), *args[1:]))
            module.register_forward_hook(lambda _m, _args, out, leave=leave: leave(out))

    for name, module in model.named_modules():  # GPT-OSS's sinks: a parameter of attn itself, not a Linear's
        if getattr(module, "sinks", None) is not None:
            module.sinks = _sliced(module.sinks, local_param(styles, name + ".sinks", full[name + ".sinks"], t, r)[1])
    for name, p in model.named_parameters():
        _, box, extra, replicas = local_param(styles, name, full[name], t, r)
        meta = metas[p]
        if box is not None:
            meta.full_shape, meta.box = full[name], box
        else:
            meta.replicas = replicas
        if extra:
            meta.reduce = DATA_DIMS + extra
        if "kv_groups" in param_style(styles, name):
            meta.tp_share = t // param_style(styles, name)["kv_groups"]
    return model, styles
