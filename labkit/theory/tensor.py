"""Tensor and sequence parallelism, predicted (our implementation, engines/parallel/tensor.py):
activations saved for backward and the tp collectives per step (Shoeybi et al. 2019;
Korthikanti et al. 2022). Which parameters a tp rank holds is the plan's (plans/tensor.py,
read by theory/params.py). Per block and microbatch, with s' = s/t under SP (else s):
    activations  act·(2bs'h + 2bsh + 4bsh/t + 2bsf/t + 4bs') + 4(a/t)bs
    comm         TP: 4L + 2 all-reduces of B = act·b·s·h; SP: as many all-gathers and
                 reduce-scatters of B, which cost on the wire what the all-reduce does
What each term is, MoE layers (replicated over tp), pipelines and recomputation: ARCHITECTURE.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.precision import ELEM
from labkit.theory.batch import microbatch_rows
from labkit.theory.experts import layer_activation_bytes
from labkit.theory.pipeline import stage_layers


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
) -> int:
    """Bytes our TP (+ SP) model saves for backward for one microbatch of `batch` rows on one
    rank (ARCHITECTURE.md counts them): model.layers blocks, plus the head and the embedding if
    asked. seq: the rank's sequence (default the model's; s/cp under CP). megatron_regather: count the
    column-parallel inputs as s/t shards, as Megatron keeps them."""
    b, h, f, a, v = batch, model.hidden, model.ffn, model.heads, model.vocab
    s = seq or model.seq
    rows = s // tp if sp else s  # residual-stream rows this rank holds
    kept = rows if megatron_regather else s  # rows of the column-parallel inputs kept
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
    coordinate `pp_rank` issues per step (ARCHITECTURE.md counts them)."""
    if cfg.tp == 1:
        return []
    m = cfg.microbatches
    L, first, last = stage_layers(cfg, model, pp_rank)
    ends = int(first) + int(last)  # the embedding's and the head's
    again = 2 if cfg.recompute in ("full", "op") else 1  # recomputation repeats a block's forward
    b = microbatch_rows(cfg)
    B = ELEM[cfg.precision] * b * (model.seq // cfg.cp) * model.hidden
    moe = bool(model.experts)
    if cfg.sequence_parallel:  # per layer forward (+ backward): attention AG, RS (+ RS, AG); MLP the same,
        gather = L * (2 * again + 2) + ends  # MoE AG (+ AG of its output's gradient)
        scatter = L * ((1 if moe else 2) * (again + 1)) + ends
        rows = [
            ("all_gather", B, gather * m, "into column-parallel / MoE regions (fwd), out of row-parallel (bwd)"),
            ("reduce_scatter", B, scatter * m, "out of row-parallel regions (fwd), into column-parallel (bwd)"),
        ]
    else:  # per layer: g after wo (and fc2) forward, f before attention (and MLP) backward
        reduce = L * ((1 if moe else 2) * (again + 1)) + ends
        rows = [("all_reduce", B, reduce * m, "g after row-parallel layers (fwd), f before column-parallel (bwd)")]
    if last:
        s = model.seq // cfg.cp
        rows += [
            ("all_reduce", 4 * b * s, m, "vocab-parallel loss: max logit"),
            ("all_reduce", 8 * b * s, m, "vocab-parallel loss: sum of exponentials, target logit"),
        ]
    # the squared gradient norm's all-reduce is theory/sharding.py grad_norm (over every splitting dim)
    return rows


def per_layer(cfg: ParallelConfig, model: ModelConfig) -> dict[str, int]:
    """Payload bytes one transformer layer moves per microbatch, per op (forward + backward)."""
    B = ELEM[cfg.precision] * microbatch_rows(cfg) * (model.seq // cfg.cp) * model.hidden
    if cfg.sequence_parallel:
        return {"all_gather": 4 * B, "reduce_scatter": 4 * B}
    return {"all_reduce": 4 * B}


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Add every rank's tp collectives (one step) to `comm` (a theory/comm.py Comm)."""
    if cfg.tp == 1:
        return
    label = layout.label("tp")
    for rank in comm.ranks(layout):
        for op, payload, calls, _ in collectives(cfg, model, layout.coords(rank)["pp"]):
            comm.add(rank, label, op, payload, cfg.tp, calls)
