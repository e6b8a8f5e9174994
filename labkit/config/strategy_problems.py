"""What the pipeline schedule, the context-parallel kind and HSDP need of the layout and the model,
each problem with a fix; validation.problems asks these. Plain Python, the ladder's bottom rung.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.config import ModelConfig, ParallelConfig


@lru_cache(maxsize=64)
def _windowed(model: ModelConfig) -> bool:
    # once per model: the planner asks context_problems of ~15,000 layouts of 126 layers
    return any(model.layer_window(i) for i in range(model.layers))


def context_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """What a cp_kind needs of the layout and the model."""
    kind = cfg.context
    if kind.hierarchical and cfg.cp > 1 and _windowed(model):
        return [
            f"cp_kind='hierarchical' with sliding-window layers (sliding_window={model.sliding_window} < "
            f"seq={model.seq}) is not built: its ring crosses runs of tokens, not the zigzag chunks the window "
            "exchange reads; use cp_kind='ring' or 'allgather' (window exchange) or 'ulysses'"
        ]
    if kind.hierarchical:
        if not (1 < cfg.cp_a2a < cfg.cp and cfg.cp % cfg.cp_a2a == 0):
            return [
                f"cp_kind='hierarchical' needs cp_a2a strictly between 1 and cp={cfg.cp} and dividing it "
                f"(got cp_a2a={cfg.cp_a2a}); try cp_a2a={next((k for k in range(2, cfg.cp) if cfg.cp % k == 0), 2)}, "
                "or cp_kind='ulysses' (all-to-all over all of cp) or 'ring'"
            ]
    elif cfg.cp_a2a != 1:
        return [f"cp_a2a={cfg.cp_a2a} only applies to cp_kind='hierarchical'; set cp_a2a=1 or cp_kind='hierarchical'"]
    if cfg.cp == 1:
        if kind.ring:
            return []
        return [f"cp_kind={cfg.cp_kind!r} applies with cp > 1; set cp=2 or leave cp_kind='ring'"]
    if not kind.splits_heads:
        return []
    out = []
    # the all-to-all hands each of its ranks whole heads: the heads a tp rank holds split over them
    n, over = (cfg.cp_a2a, "cp_a2a") if kind.hierarchical else (cfg.cp, "cp")
    heads, kv = model.heads // max(1, cfg.tp), max(1, model.n_kv_heads // cfg.tp)
    if heads % n:
        out.append(
            f"cp_kind={cfg.cp_kind!r} splits the heads over {over}: heads/tp = {model.heads}/{cfg.tp} = {heads} is "
            f"not divisible by {over}={n}; use cp_kind='allgather' or 'ring', or a {over} dividing {heads}"
        )
    elif kv % n:
        # refused rather than replicated: copies of a KV head would send nh/nkv times the K/V bytes
        out.append(
            f"cp_kind={cfg.cp_kind!r} splits the KV heads over {over}: kv_heads/tp = {model.n_kv_heads}/{cfg.tp} -> "
            f"{kv} is not divisible by {over}={n}; use cp_kind='allgather' (K/V are small under GQA) or 'ring'"
        )
    return out


def hybrid_problems(cfg: ParallelConfig) -> list[str]:
    """What HSDP (dp_replicate > 1) needs: dp cut into whole shard groups of 2 or more ranks, a
    sharding to apply inside them, and an implementation that runs it."""
    r, dp = cfg.dp_replicate, cfg.dp
    if r == 1:
        return []
    if dp % r:
        fits = [k for k in range(2, dp) if dp % k == 0 and dp // k > 1]
        return [
            f"dp_replicate={r} does not divide dp={dp} (HSDP cuts dp into dp_replicate equal shard groups); "
            f"try dp_replicate in {fits} or 1"
            if fits
            else f"dp_replicate={r} does not divide dp={dp}; try 1"
        ]
    out = []
    if not cfg.sharded.optimizer:
        out.append(
            f"dp_replicate={r} with sharding='none': HSDP shards inside each group and DDP shards nothing; "
            "set sharding='fsdp' (or 'zero1'/'zero2'/'zero3'), or dp_replicate=1"
        )
    elif dp == r:
        out.append(
            f"dp_replicate={r} = dp leaves shard groups of one rank, which is DDP with ZeRO's bookkeeping; "
            f"use a dp_replicate below dp (dp_shard = dp / dp_replicate >= 2), or sharding='none' with dp_replicate=1"
        )
    if cfg.torch_impl and (cfg.tp > 1 or cfg.pp > 1):
        out.append(
            f"impl='torch' with dp_replicate={r} and tp={cfg.tp}, pp={cfg.pp}: FSDP2's HSDP runs on a 2-D "
            "(dp_replicate, dp_shard) mesh here; with tp or pp (a 3-D mesh) it is not built yet; use impl='lab'"
        )
    return out


def schedule_problems(cfg: ParallelConfig) -> list[str]:
    """How the schedule, the chunks per rank and the microbatches fit together."""
    out, m, pp = [], cfg.microbatches, cfg.pp
    if cfg.pipeline.interleaved and cfg.virtual_stages < 2:
        out.append("schedule='interleaved' needs virtual_stages >= 2; try virtual_stages=2")
    if cfg.pipeline.v_shaped and cfg.virtual_stages != 2:
        out.append(f"schedule={cfg.schedule!r} places two chunks per rank in a V; set virtual_stages=2")
    if cfg.virtual_stages > 1 and not (cfg.pipeline.interleaved or cfg.pipeline.v_shaped):
        out.append(
            f"virtual_stages={cfg.virtual_stages} only applies to schedule='interleaved' (or 2 to 'zbv', "
            "'dualpipev'); set schedule='interleaved' or virtual_stages=1"
        )
    if cfg.pipeline.interleaved and pp > 1 and m % pp:
        out.append(
            f"interleaved 1F1B needs microbatches ({m}) to be a multiple of pp ({pp}), as in Megatron; "
            f"try microbatches={pp * max(1, m // pp)}"
        )
    need = cfg.pipeline.microbatches_per_stage * pp
    if pp > 1 and m < need:
        out.append(
            f"schedule={cfg.schedule!r} needs microbatches ({m}) >= {cfg.pipeline.microbatches_per_stage} * pp, "
            f"one per stage of the V, as DeepSeek's DualPipeV does; try microbatches={need}"
        )
    return out


# What PyTorch offers for each ZeRO stage (impl='torch'), or why nothing: the reason in the refusal.


def float8_not_built(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """What precision='fp8' does not run on the engines (the theory prices it all): each named, with a
    fix. Built: dense models' blocks in fp8 under DDP, ZeRO-1/2/3 and FSDP (ours, and FSDP2 with its
    float8 all-gather), TP + SP (ours, tensorwise), FSDP2 with torchao's float8 TP styles (without SP)
    and the pipeline schedules (ours)."""
    if not cfg.numerics.fp8:
        return []
    scaling, out = cfg.fp8_scaling, []
    if scaling.not_built:
        out.append(scaling.not_built)
    if model.experts:
        out.append(
            "precision='fp8' with an MoE model is not built: torchtitan converts the experts' grouped matmuls "
            "with its Float8GroupedExpertsConverter (CUDA kernels only); use experts=0 or precision='bf16'"
        )
    if model.family.latent_attention:
        out.append(
            "precision='fp8' with multi-head latent attention (deepseek_v3) is not built: its latents' "
            "projections and norms are not the blocks' dense layers labkit converts; use precision='bf16'"
        )
    if cfg.cp > 1:
        out.append(
            f"precision='fp8' with cp={cfg.cp} is not built: each cp rank would cast its own s/cp positions "
            "with their own amax, a split no one-process fp8 reference shares; use cp=1 or precision='bf16'"
        )
    if cfg.compile:
        out.append("precision='fp8' with compile=True is not built; use compile=False")
    if cfg.dp_replicate > 1:
        out.append("precision='fp8' with HSDP (dp_replicate > 1) is not built; use dp_replicate=1")
    if cfg.recomputation.recomputes:
        out.append("precision='fp8' with checkpoint_activations is not built; use checkpoint_activations=False")
    if cfg.torch_impl and (cfg.pp > 1 or not cfg.sharded.fsdp):
        out.append(
            "precision='fp8' with impl='torch' runs FSDP2 (sharding='fsdp', pp=1: torchao's float8 all-gather; "
            "with tp > 1 torchao's float8 TP styles, torchtitan's 2-D); use impl='lab' for DDP, ZeRO and "
            "the pipeline in fp8"
        )
    if cfg.torch_impl and cfg.sequence_parallel and not scaling.rowwise:
        out.append(
            "precision='fp8' with impl='torch' and sequence_parallel=True is not built: torchao's float8 SP "
            "(PrepareFloat8ModuleInput) all-gathers float8_e4m3fn DTensors, a dtype gloo's all-gather refuses "
            "('Invalid scalar type'); use impl='lab' (its fp8 gather moves the same bytes as uint8) or "
            "sequence_parallel=False"
        )
    if cfg.tp > 1 and scaling.rowwise:
        out.append(
            "fp8_recipe='rowwise' with tp > 1 is not built: torchtitan's float8 TP (torchao's Float8ColwiseParallel, "
            "Float8RowwiseParallel) is tensorwise only; use fp8_recipe='tensorwise' or tp=1"
        )
    if cfg.tp > 1 and cfg.sharded.params and not scaling.rowwise and not cfg.torch_impl:
        out.append(
            f"precision='fp8' with tp={cfg.tp} and sharding={cfg.sharding!r} is not built: a shard's weight amax "
            "would need the MAX over both the unit's dp group and tp (DTensor does it for FSDP2: impl='torch'); "
            "use sharding='none', 'zero1' or 'zero2'"
        )
    if cfg.tp > model.n_kv_heads:
        out.append(
            f"precision='fp8' with tp={cfg.tp} > kv_heads={model.n_kv_heads} is not built: each rank would cast "
            "its partial gradient of a shared KV head to e5m2 before their sum; use tp <= kv_heads"
        )
    return out
