"""What a GPU really holds at the peak of a training step, term by term: besides the model states
and the activations saved for backward, the terms that decide an out-of-memory in practice. Each
term is modelled and named; DERIVATIONS.md ("What a GPU holds") gives the sources.

  params, grads, optimizer  the ZeRO paper's accounting (Rajbhandari et al., SC 2020, figure 1),
                FSDP2's for FSDP; gradients only where they exist at the peak
  activations   saved for backward by the microbatches in flight (theory/exact/activations.py's bytes
                per chunk, the schedule's count in flight: pipeline.in_flight)
  recompute     one block rebuilt in backward (full / op checkpointing)
  gathered      FSDP / ZeRO-3's unsharded parameters: the root unit (embedding, head) and two
                blocks (one computing, one prefetched); with pp, the whole stage (no reshard)
  reduce_buffers  gradients waiting for their reduction: a block's bf16 gradients and their fp32
                copy (FSDP), the whole stage's fp32 accumulation (FSDP under pp), two buckets (ZeRO-1/2)
  logits        the loss's backward: nll's dense fp32 gradient and log_softmax's, 8·b·s·V/tp bytes;
                with ModelConfig.loss='fused' the gradient in the compute dtype and one fp32 chunk
  temporaries   the largest op's backward buffers: the MLP's intermediate gradients, or flash
                attention's fp32 dq accumulator with dq, dk, dv
  cuda_context  the CUDA context and library handles, outside PyTorch's allocator
  nccl          NCCL's buffers: per communicator, 2 directions x channels x NCCL_BUFFSIZE
  allocator     reserved minus allocated in PyTorch's caching allocator (a measured fraction)
  workspaces    cuBLAS's workspaces in the allocator, where measured on the device (Hardware.workspace);
                not a term at all where not measured (the Hardware's assumptions say so)
The peak counts the larger of `logits` and `recompute + temporaries` (the loss's backward comes
before any block's), everything else together. This is the at-scale model of a CUDA GPU, in closed
form for the search; what labkit's engines hold on one rank, to the byte, is the exact estimate's
(theory/exact/per_rank.py, with theory/exact/memory.py's formulas), which has none of the terms
outside PyTorch's tensors.
"""

from __future__ import annotations

from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.choices import pipeline_shape
from labkit.layout.precision import ELEM, GATHER, LOSS_CHUNK, REDUCE
from labkit.theory.exact.activations import chunk
from labkit.theory.exact.latent import kv_width
from labkit.theory.exact.pipeline import in_flight
from labkit.theory.planner.hardware import Hardware
from labkit.theory.planner.stages import Stage, rank_params, stage_params

ALLOCATED = ("params", "grads", "optimizer", "activations", "gathered", "reduce_buffers")
TRANSIENT = ("logits", "recompute", "temporaries")
OUTSIDE = ("cuda_context", "nccl", "allocator")
TERMS = ALLOCATED + TRANSIENT + OUTSIDE


@lru_cache(maxsize=16384)
def _in_flight(schedule: str, p: int, m: int, rank: int, v: int) -> int:
    """Microbatches (chunks of microbatches, interleaved) whose activations rank r holds at
    its peak: GPipe m, 1F1B min(m, p - r) (Narayanan et al. 2021, section 2.1), interleaved
    Megatron-LM's warm-up count plus one, min(m·v, 2(p - r - 1) + (v - 1)p + 1) (the schedule
    walk of layout/schedules.py gives the same); any other schedule by walking it."""
    if pipeline_shape(schedule).interleaved:
        return min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
    return in_flight(schedule, p, m, rank, v)


def states(cfg: ParallelConfig, model: ModelConfig, st: Stage) -> dict[str, float]:
    """Parameters, gradients and optimizer state at the peak, sharded over the gradients' reduce
    group (dense weights over dp x ep x cp, experts over dp x cp). ZeRO's accounting (bf16 and fp8:
    2 + 2 + 12 bytes a parameter, fp32 4 + 4 + 8), except FSDP, which keeps fp32 shards of the
    parameters and gradients beside Adam's moments (FSDP2's MixedPrecisionPolicy: 4 + 4 + 8).
    Gradients exist at the peak only when another microbatch's backward came before it: the peak
    is at the loss's backward, and zero_grad(set_to_none=True) frees them after every step."""
    dense, expert = stage_params(model, cfg, st)
    # dense weights are reduced over dp·ep·cp, experts over dp·cp where ep splits them
    # (DERIVATIONS.md, "Mixture of experts and expert parallelism")
    dp = cfg.dp // cfg.dp_replicate  # HSDP shards inside a shard group only
    n = dp * cfg.ep * cfg.cp
    n_exp = dp * cfg.cp if cfg.ep > 1 else n
    # fp32: Adam's two moments; mixed: fp32 masters beside them; FSDP2 keeps fp32 shards whatever the
    # compute dtype (DERIVATIONS.md, "Data parallelism: DDP, ZeRO, FSDP")
    p, g, k = (4, 4, 8) if not cfg.numerics.mixed or cfg.sharded.fsdp else (2, 2, 12)
    sharded = dense / n + expert / n_exp
    whole = dense + expert
    z = cfg.sharded
    # one microbatch and no pipeline: the peak is the loss's backward, before any gradient exists
    accumulated = cfg.pp > 1 or cfg.microbatches > 1
    return {
        "params": p * (sharded if z.params else whole),
        "grads": g * (sharded if z.grads else whole) * accumulated,
        "optimizer": k * (sharded if z.optimizer else whole),
    }


@lru_cache(maxsize=16384)
def _chunk_bytes(
    model: ModelConfig, tp: int, cp: int, sp: bool, precision: str, ac, b: int, kind: str = "ring"
) -> tuple:
    """(a block's forward bytes, one block's rebuild, the embedding's, the head's) for one
    microbatch of b sequences: theory/exact/activations.py's chunk, which is linear in the blocks."""
    # only the fields activations depend on, so the cache serves every mesh with the same block
    cfg = ParallelConfig(
        tp=tp, cp=cp, sequence_parallel=sp, precision=precision, checkpoint_activations=ac, global_batch=b, cp_kind=kind
    )
    # one block: chunk() is linear in the blocks, so a stage's is this times its blocks
    one = chunk(cfg, model, 1, head=False, embed=False)
    embed = chunk(cfg, model, 0, head=False, embed=True).forward
    return one.forward, one.backward_extra, embed, chunk(cfg, model, 0, head=True, embed=False).forward


def activation_terms(cfg: ParallelConfig, model: ModelConfig, st: Stage, ac=None) -> dict[str, float]:
    """Saved activations of the microbatches in flight on this rank (interleaved: chunks in
    flight, each the rank's mean chunk), and one block's rebuild in backward. `ac`: the
    checkpointing to price (default the config's)."""
    p, v, m = cfg.pp, cfg.virtual_stages if cfg.pp > 1 else 1, cfg.microbatches
    # without a pipeline one microbatch is alive at a time (accumulation frees each graph first)
    flying = 1 if p == 1 else _in_flight(cfg.schedule, p, m, st.rank, v)
    b = cfg.global_batch // (cfg.dp * cfg.ep * m)
    ac = cfg.checkpoint_activations if ac is None else ac
    args = (model, cfg.tp, cfg.cp, cfg.sequence_parallel, cfg.precision, ac, b, cfg.cp_kind)
    block, extra, embed, head = _chunk_bytes(*args)
    # `flying` (chunk-)microbatches of the rank's mean chunk; the embedding's ids for each microbatch
    # in flight, at most m of them
    total = flying * block * st.layers / st.chunks + min(flying, m) * embed * st.embed + head * st.head
    # a stage with no blocks rebuilds nothing
    return {"activations": total, "recompute": extra if st.layers else 0.0}


def buffer_terms(cfg: ParallelConfig, model: ModelConfig, st: Stage) -> dict[str, float]:
    """FSDP / ZeRO's gathered parameters and reduction buffers."""
    rp = rank_params(model, cfg.tp, cfg.ep)
    dense, expert = stage_params(model, cfg, st)
    e, unit = ELEM[cfg.precision], rp.dense + rp.expert
    # the root unit (embedding, head) where this stage holds them
    root = rp.embed * st.embed + rp.head * st.head
    if cfg.sharded.params:
        if cfg.pp > 1:  # torchtitan under pp: no reshard, gradients accumulated unsharded in fp32
            return {"gathered": GATHER[cfg.precision] * (dense + expert), "reduce_buffers": REDUCE * (dense + expert)}
        # gathered: the root, the block computing and the one prefetched; reduced: a block's gradients in
        # the compute dtype, and in fp32 for its reduce-scatter and for the one still in flight
        return {"gathered": GATHER[cfg.precision] * (root + 2 * unit), "reduce_buffers": (e + 2 * REDUCE) * unit}
    if cfg.sharded.optimizer:  # ZeRO-1 / 2
        # two fp32 buckets, one filling while the other reduces; never more than the whole stage
        return {"gathered": 0.0, "reduce_buffers": 2 * REDUCE * min(dense + expert, cfg.bucket_mb * 2**20 / e)}
    return {"gathered": 0.0, "reduce_buffers": 0.0}  # DDP's buckets are views of the gradients


def transient_terms(cfg: ParallelConfig, model: ModelConfig, st: Stage) -> dict[str, float]:
    """The loss's backward on the head's rank; the largest op's backward buffers."""
    key = (cfg.precision, cfg.global_batch, cfg.dp, cfg.ep, cfg.microbatches, cfg.cp, cfg.tp, cfg.cp_kind)
    return _transient(model, key, st.head, st.layers > 0)


@lru_cache(maxsize=16384)
def _transient(model: ModelConfig, key: tuple, head: bool, blocks: bool) -> dict[str, float]:
    # what transient_terms reads of the layout and the stage, and nothing else: the search asks it ~90,000 times
    precision, global_batch, dp, ep, microbatches, cp, tp, cp_kind = key
    cfg = ParallelConfig(
        precision=precision, global_batch=global_batch, dp=dp, ep=ep, microbatches=microbatches, cp=cp, tp=tp,
        cp_kind=cp_kind, cp_a2a=2 if cp_kind == "hierarchical" else 1,
    )  # fmt: skip
    e = ELEM[cfg.precision]
    b = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
    tokens = b * model.seq // cfg.cp
    # the logits exist only on the head's rank, V/tp of them each (the vocab-parallel loss)
    n = tokens * model.vocab / cfg.tp if head else 0.0  # the logits on this rank
    # 'fused': the gradient in the compute dtype and one chunk's fp32 softmax; 'fp32': 8 bytes a logit
    logits = e * n + 4 * min(n, LOSS_CHUNK) if model.fused_loss else 8 * n
    kv = model.n_kv_heads * model.head_dim
    # the MLP's backward holds its intermediate gradients, 3 of (T, f/t) under SwiGLU (gate, up and
    # their product), 2 under GELU; attention's: the fp32 dq accumulator with dq, dk and dv
    mats = 3 if model.family.gated_mlp else 2
    mlp = mats * e * tokens * model.ffn / cfg.tp
    attention = ((4 + e) * model.hidden + 2 * e * kv) * tokens / cfg.tp
    local_kv = max(1, model.n_kv_heads // cfg.tp) * model.head_dim
    if model.family.latent_attention:  # MLA: q, k, v and their gradients at the kernel's width, per local head
        local_kv = kv_width(model, cfg.tp)
        attention = (4 + 3 * e) * local_kv * tokens
    if cfg.cp > 1 and cfg.context.gathers:
        # the all-gather kind's backward holds every cp rank's K/V (compute dtype) and their fp32 dK/dV
        # (engines/parallel/context/kinds.py): cp times this rank's K and V, at e + 4 bytes
        attention += cfg.cp * (e + 4) * 2 * tokens * local_kv
    # ops run one at a time: the larger of the two is the peak
    return {"logits": logits, "temporaries": max(mlp, attention) if blocks else 0.0}


def communicators(cfg: ParallelConfig) -> int:
    """Process groups with more than one rank that a rank talks in (each dim, and the combined
    data-parallel group when it is more than dp)."""
    dims = [d for d in ("tp", "cp", "ep", "dp", "pp") if getattr(cfg, d) > 1]
    # the combined dp-cp-ep group of the gradient reduction is a communicator of its own
    combined = 1 if cfg.dp > 1 and (cfg.cp > 1 or cfg.ep > 1) else 0
    # HSDP talks in dp's two halves (dp_shard, dp_replicate) instead of dp: one more
    return len(dims) + combined + (1 if cfg.dp_replicate > 1 else 0)


def nccl_bytes(cfg: ParallelConfig, hw: Hardware) -> float:
    """NCCL's buffers: per communicator, 2 directions x channels x NCCL_BUFFSIZE."""
    return communicators(cfg) * 2 * hw.nccl_channels * hw.nccl_buffer


def memory_terms(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, st: Stage, ac=None) -> dict[str, float]:
    """Every term (TERMS) of what one GPU at pipeline rank `st` holds at its peak, in bytes
    (`ac`: the checkpointing to price, default the config's)."""
    out = {**_held(cfg, model, st), **activation_terms(cfg, model, st, ac), **transient_terms(cfg, model, st)}
    del out["total"]
    measured = {} if hw.workspace is None else {"workspaces": float(hw.workspace)}
    allocated = allocated_bytes({**out, **measured})
    out["cuda_context"] = hw.context
    out["nccl"] = nccl_bytes(cfg, hw)
    # a measured fraction of the allocated peak (hardware.py: 1.19-1.29 reserved / allocated)
    out["allocator"] = hw.allocator * allocated
    return {**{k: float(out[k]) for k in TERMS}, **measured}


def required(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, st: Stage, ac=None) -> float:
    """required_bytes(memory_terms(...)), as the planner's search asks it thousands of times."""
    return allocated_at(cfg, model, st, ac) + outside_allocations(cfg, hw)


def outside_allocations(cfg: ParallelConfig, hw: Hardware) -> float:
    """What every candidate of `cfg` needs besides its tensors: the CUDA context, NCCL's buffers and,
    where measured, cuBLAS's workspaces (0 where not: no term is invented)."""
    return hw.context + nccl_bytes(cfg, hw) + (hw.workspace or 0.0)


def allocated_at(cfg: ParallelConfig, model: ModelConfig, st: Stage, ac=None) -> float:
    """allocated_bytes(memory_terms(...)) without building its dict: the search asks this for every candidate."""
    held = _held(cfg, model, st)
    acts = activation_terms(cfg, model, st, ac)
    trans = transient_terms(cfg, model, st)
    # the loss's backward comes before any block's: the larger of the two, never both
    return held["total"] + acts["activations"] + max(trans["logits"], acts["recompute"] + trans["temporaries"])


def _held(cfg: ParallelConfig, model: ModelConfig, st: Stage) -> dict[str, float]:
    """States and buffers, which the microbatch, the schedule and the checkpointing leave alone."""
    fields = (cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.virtual_stages, cfg.sharding, cfg.precision, cfg.bucket_mb)
    fields += (min(cfg.microbatches, 2), cfg.dp_replicate)  # whether gradients accumulate (states); HSDP
    return _held_cached(model, fields, cfg.stage_layers, st)


@lru_cache(maxsize=65536)
def _held_cached(model: ModelConfig, fields: tuple, uneven: tuple, st: Stage) -> dict[str, float]:
    names = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "sharding", "precision", "bucket_mb", "microbatches")
    names += ("dp_replicate",)
    # rebuilt from the key alone, so a field the key leaves out cannot leak into the cached value
    cfg = ParallelConfig(**dict(zip(names, fields)), stage_layers=uneven)
    out = {**states(cfg, model, st), **buffer_terms(cfg, model, st)}
    out["total"] = sum(out.values())
    return out


def allocated_bytes(terms: dict[str, float]) -> float:
    """What PyTorch's allocator has handed out at the peak (torch.cuda.max_memory_allocated)."""
    transient = max(terms["logits"], terms["recompute"] + terms["temporaries"])
    return sum(terms[k] for k in ALLOCATED) + transient + terms.get("workspaces", 0.0)


def reserved_bytes(terms: dict[str, float]) -> float:
    """What the allocator holds from the device (torch.cuda.max_memory_reserved)."""
    return allocated_bytes(terms) + terms["allocator"]


def required_bytes(terms: dict[str, float]) -> float:
    """What a step cannot run without: the allocated peak, the CUDA context and NCCL's buffers.
    The allocator's reserve is not in it: PyTorch's caching allocator frees its unused cached
    blocks and retries before it raises out-of-memory (c10/cuda/CUDACachingAllocator.cpp,
    `malloc`: release_cached_blocks on a failed cudaMalloc), so a step whose reserve would not
    fit still runs, with those retries. Of the 83 published runs (theory/planner/published.py), which
    all ran, 37 would not fit if the reserve counted."""
    return allocated_bytes(terms) + terms["cuda_context"] + terms["nccl"]


def peak_bytes(terms: dict[str, float]) -> float:
    """Everything the GPU holds: reserved, plus the CUDA context and NCCL's buffers."""
    return reserved_bytes(terms) + terms["cuda_context"] + terms["nccl"]
