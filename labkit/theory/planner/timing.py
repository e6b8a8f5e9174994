"""The time model: one training step of a layout, priced op by op, so that it can be right for
the right reason (the derivation and its sources: DERIVATIONS.md, "The time model").

Compute: each op of a microbatch (theory/planner/ops.py) on a roofline, max(FLOPs / (peak · efficiency),
bytes / (HBM · efficiency)) with the hardware's measured efficiencies (theory/planner/hardware.py); the
backward at its multiple of the forward; recomputation by mode (full: the block's forward again;
selective: the attention kernel's; op: the forward of what torchtitan's policy does not keep).

Communication: α·steps + wire bytes / β per collective (Hockney; wire bytes by the ring model,
labkit/layout/wire.py) on NVLink inside a node, the NIC across nodes. Overlap: tensor-parallel
collectives, expert all-to-alls and pipeline sends are on the critical path; ring attention's hops
hide behind each layer's attention kernel; the data-parallel traffic is theory/planner/overlap.py's. The
pipeline stretches the slowest stage's microbatches by (m·v + p − 1) / (m·v).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.choices import Recomputation, recomputation
from labkit.layout.precision import ELEM, REDUCE
from labkit.layout.window import rows_of, window_plan
from labkit.theory.exact.latent import kv_width
from labkit.theory.planner.hardware import H100, HARDWARE, Hardware, Link, attention_rate
from labkit.theory.planner.ops import OPTIMIZER_BYTES, Op, block_ops, embed_ops, head_ops, model_flops_per_token
from labkit.theory.planner.overlap import DataParallel, collective_seconds, link_of, ring, run_link, spans_nodes
from labkit.theory.planner.stages import Stage, distinct

__all__ = [
    "H100",
    "HARDWARE",
    "Hardware",
    "Link",
    "StepTime",
    "step_time",
    "Phase",
    "phase",
    "collective_seconds",
    "spans_nodes",
]


@dataclass(frozen=True)
class Phase:
    """Seconds of a list of ops for one microbatch."""

    forward: float
    backward: float
    attention_forward: float
    unkept_forward: float
    """The forward of the ops torchtitan's per-op policy does not keep (recomputed)."""
    compute_bound: float
    memory_bound: float
    """Forward + backward seconds of the ops on each side of the roofline."""

    def recompute(self, r: Recomputation) -> float:
        """Seconds `r` rebuilds in backward: the block's forward (full), the attention's
        (selective), or what the per-op policy did not keep (op)."""
        if not r.recomputes:
            return 0.0
        if r.attention_only:
            return self.attention_forward
        return self.unkept_forward if r.per_op else self.forward


def op_seconds(op: Op, hw: Hardware, scale: float = 1.0) -> tuple[float, bool]:
    """(seconds, whether memory-bound) of `scale` times the op's forward, on the roofline."""
    rate = {
        "matmul": hw.flops * hw.matmul_eff,
        "fp8-matmul": hw.fp8_flops * hw.fp8_matmul_eff,
        # flash attention's rate falls for short blocks and head dim 64, as measured (hardware.py)
        "attention": attention_rate(hw, op.head_dim, op.length),
    }.get(op.kind)
    # an elementwise kernel has no FLOP rate: its bytes alone price it, at the stack's pace (stacks.py)
    compute = scale * op.flops / rate if rate else 0.0
    memory = scale * op.bytes / (hw.hbm * hw.hbm_eff) * (hw.slowdown_at(op.bytes) if op.kind == "memory" else 1.0)
    # the roofline: a kernel overlaps its arithmetic and its memory traffic, so the slower side is its time
    return max(compute, memory), memory > compute


# a block's ops are the same for every mesh with the same (tp, cp, SP, b, precision): priced once
@lru_cache(maxsize=8192)
def phase(ops: tuple[Op, ...], hw: Hardware) -> Phase:
    fwd = bwd = attn = unkept = bound_c = bound_m = 0.0
    for op in ops:
        f, f_mem = op_seconds(op, hw)
        # backward at its multiple of the forward: 2 for a matmul (input and weight gradients), 2.5 for
        # flash attention, each memory op its own bytes
        b, b_mem = op_seconds(op, hw, op.backward)
        fwd, bwd = fwd + f, bwd + b
        attn += f if op.kind == "attention" else 0.0
        unkept += 0.0 if op.kept else f
        # each side's seconds, so that the step can say which side of the roofline it spends its time on
        bound_m += f * f_mem + b * b_mem
        bound_c += f * (not f_mem) + b * (not b_mem)
    return Phase(fwd, bwd, attn, unkept, bound_c, bound_m)


@dataclass
class StepTime:
    total: float
    """Seconds of one optimizer step."""
    compute: float
    """Seconds the slowest pipeline rank computes (recomputation included)."""
    bubble: float
    """Seconds it idles in the pipeline's fill and drain."""
    optimizer: float
    comm: dict[str, float]
    """Seconds of each dim's collectives in one step (on the slowest pipeline rank)."""
    exposed: dict[str, float]
    """What of each dim's communication is not hidden behind compute."""
    parts: dict[str, float] = field(default_factory=dict)
    """Compute seconds: compute-bound ops, memory-bound ops (recomputation included in both), and
    of those the recomputation."""
    flops: float = 0.0
    """Model FLOPs per GPU per step (PaLM's 6N + 12·L·h·s per token)."""
    mfu: float = 0.0
    """flops / (total · the hardware's dense peak in the layout's precision: bf16's, fp8's for fp8)."""
    dominant: str = "compute"
    """'compute' or 'memory' (whichever side of the roofline the step's ops spend more time on),
    or the dim whose exposed communication outweighs both."""


@dataclass
class Microbatch:
    """One microbatch on one pipeline rank."""

    compute: float
    parts: dict[str, float]
    comm: dict[str, float]
    exposed: dict[str, float]

    @property
    def seconds(self) -> float:
        return self.compute + sum(self.exposed.values())


def microbatch(
    cfg: ParallelConfig, model: ModelConfig, hw: Hardware, st: Stage, b: int, dp: DataParallel
) -> Microbatch:
    """Compute and critical-path communication of one microbatch of b sequences on rank `st`."""
    key = (model, cfg.tp, cfg.cp, cfg.sequence_parallel, b, cfg.precision)
    block, head, embed = phase(block_ops(*key), hw), phase(head_ops(*key), hw), phase(embed_ops(*key), hw)
    r, L = cfg.recomputation, st.layers
    # the head and the embedding count only on the stages that hold them
    ends = [(head, st.head), (embed, st.embed)]
    again = L * block.recompute(r)
    compute = L * (block.forward + block.backward) + again
    compute += sum((p.forward + p.backward) * held for p, held in ends)
    parts = {
        "compute-bound": L * block.compute_bound + sum(p.compute_bound * h for p, h in ends),
        "memory-bound": L * block.memory_bound + sum(p.memory_bound * h for p, h in ends),
        "recompute": again,
    }
    # the recomputation joins the side of the roofline its block's ops mostly sit on
    parts["compute-bound" if block.compute_bound >= block.memory_bound else "memory-bound"] += again
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}

    def add(dim: str, total: float, hidden: float = 0.0) -> None:
        if total > 0:
            comm[dim] = comm.get(dim, 0.0) + total
            exposed[dim] = exposed.get(dim, 0.0) + max(0.0, total - hidden)

    e, s, h = ELEM[cfg.precision], model.seq // cfg.cp, model.hidden
    repeat = r.reruns_forward  # the block's forward collectives run again
    # tensor parallelism: per layer 4 all-reduces of (b, s, h) (SP: all-gather + reduce-scatter
    # pairs, the same bytes), 2 more when the forward is recomputed; the embedding's and the
    # head's input on the end stages
    tp_calls = L * (4 + 2 * repeat) + 2 * (st.head + st.embed)
    # nothing hides TP's collectives: the next op needs their result
    add("tp", tp_calls * ring("all_reduce", e * b * s * h, cfg.tp, link_of(cfg, ("tp",), hw)))
    # sliding-window layers (Gemma 3) exchange their window's rows instead of the ring's or the gather's
    # K/V (labkit/layout/window.py); a stage holds its share of them: the model's fraction, at scale
    local = L * _window_share(cfg, model)
    L_kind = L - local
    if local:
        add("cp", local * _window_exchange(cfg, model, hw, b, r.recomputes))
    if cfg.cp > 1 and not (cfg.context.ring and not cfg.context.splits_heads):
        add("cp", L_kind * _context_collectives(cfg, model, hw, b, r.recomputes))
    if cfg.cp > 1 and cfg.context.ring:  # ring attention: n-1 hops of K/V forward, of K/V and fp32 dK/dV backward
        # hierarchical: the ring across the cp / cp_a2a runs, on the link the whole cp group spans
        n = cfg.cp // cfg.cp_a2a if cfg.context.hierarchical else cfg.cp
        link = link_of(cfg, ("cp",), hw)
        kv = 2 * b * s * model.n_kv_heads * model.head_dim // cfg.tp
        if model.family.latent_attention:  # MLA: the up-projected heads, padded to one width (latent.py)
            kv = 2 * b * s * kv_width(model, cfg.tp)
        # Hockney per hop: α + bytes/β; K/V in the compute dtype, the dK/dV accumulators in fp32
        hop, dhop = link.alpha + e * kv / link.beta, link.alpha + REDUCE * kv / link.beta
        fwd, bwd = (n - 1) * hop, (n - 1) * (hop + dhop)
        # every recomputation runs the ring once more in backward, selective included
        again_cp = fwd if r.recomputes else 0.0
        # the hops hide behind the attention kernel of their pass: the forward's, the backward's (2.5 times
        # it, FlashAttention-2's five products against two) with the recomputed forward
        for total, kernel in (
            (fwd, block.attention_forward),
            (bwd + again_cp, (2.5 + r.recomputes) * block.attention_forward),
        ):
            add("cp", L_kind * total, L_kind * kernel)  # the global layers' rings
    if cfg.ep > 1 and model.experts:  # dispatch and combine, forward and backward
        a2a = ring("all_to_all", e * b * s * model.top_k * h, cfg.ep, link_of(cfg, ("ep",), hw))
        # exposed: the experts need the dispatched rows and the next layer the combined ones
        add("ep", L * (4 + 2 * repeat) * a2a)
    if cfg.pp > 1:  # each chunk sends its output forward and its input's gradient back
        # under SP a stage passes its s/tp rows to the same tp rank of the next stage
        rows = s // (cfg.tp if cfg.sequence_parallel else 1)
        # exposed: a stage waits for its input; two messages per chunk (the activation, its gradient)
        add("pp", st.chunks * 2 * ring("send", e * b * rows * h, 2, link_of(cfg, ("pp",), hw)))
    for dim, total, hidden in dp.per_microbatch(st, block):
        add(dim, total, hidden)
    # FSDP2's copies around its collectives are memory-bound compute (DERIVATIONS.md, "The time model")
    copies = dp.copy_bytes(st, per_step=False) * hw.copy_slowdown / (hw.hbm * hw.hbm_eff)
    parts["memory-bound"] += copies
    return Microbatch(compute + copies, parts, comm, exposed)


def _window_share(cfg: ParallelConfig, model: ModelConfig) -> float:
    """The fraction of the layers whose window rows go point to point under cp (Ulysses: none, its
    all-to-alls are any layer's; a window of seq or more: none)."""
    if cfg.cp == 1 or cfg.context.splits_heads or model.layers == 0:
        return 0.0
    return sum(model.layer_window(i) is not None for i in range(model.layers)) / model.layers


def _window_exchange(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, b: int, recomputes: bool) -> float:
    """Seconds per local layer and microbatch of the window exchange (theory/exact/context.py counts its
    calls and bytes), all exposed: the attention waits for the rows. Each message α + bytes/β; the
    slowest cp rank's sends or receives, whichever is longer; forward (again when recomputed) and the
    gradients back in backward, the same rows."""
    link, e = link_of(cfg, ("cp",), hw), ELEM[cfg.precision]
    row = e * 2 * b * max(1, model.n_kv_heads // cfg.tp) * model.head_dim  # one position's K and V
    widths = {model.layer_window(i) for i in range(model.layers)} - {None}
    w = max(widths)  # the widest window of the model (Gemma 3: one width)
    worst = 0.0
    for plan in window_plan(model.seq, cfg.cp, w):
        for side in ("send", "recv"):
            t = sum(link.alpha + row * rows_of(spans) / link.beta for spans in plan[side].values())
            worst = max(worst, t)
    return (2 + recomputes) * worst


def _context_collectives(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, b: int, recomputes: bool) -> float:
    """Seconds per layer and microbatch of the collective cp kinds (theory/exact/context.py counts the
    same calls and bytes), all exposed: the attention waits for its K/V, or for its heads. All-gather:
    the cp ranks' K/V gathered in forward and again in backward, fp32 dK/dV reduce-scattered; Ulysses:
    q, K/V and the output all-to-all'd in forward, their gradients in backward (hierarchical: over a
    run of cp_a2a ranks; its ring is priced with the ring's). A recomputation runs the forward's
    collectives once more."""
    link, e, n = link_of(cfg, ("cp",), hw), ELEM[cfg.precision], cfg.cp
    if cfg.context.hierarchical:  # the all-to-all over a run of cp_a2a consecutive cp ranks: its own, nearer link
        link, n = run_link(cfg, "cp", cfg.cp_a2a, hw), cfg.cp_a2a
    s = model.seq // cfg.cp
    kv = 2 * b * s * max(1, model.n_kv_heads // cfg.tp) * model.head_dim  # this rank's K and V, elements
    forwards = 2 if recomputes else 1
    if cfg.context.gathers:
        gather, scatter = ring("all_gather", n * e * kv, n, link), ring("reduce_scatter", n * REDUCE * kv, n, link)
        return (forwards + 1) * gather + scatter
    q = b * s * (model.heads // cfg.tp) * model.head_dim  # q, and the output, elements
    return (forwards + 1) * (2 * ring("all_to_all", e * q, n, link) + ring("all_to_all", e * kv, n, link))


def step_time(cfg: ParallelConfig, model: ModelConfig, hw: Hardware = H100, world: int | None = None) -> StepTime:
    """One optimizer step of `cfg` on `model` (global_batch sequences of model.seq tokens); the
    pipeline's pace is its slowest rank's."""
    # refused before anything is priced where the hardware has no rate for the precision (fp8 on an A100)
    peak = hw.peak(cfg.precision)
    m, p = cfg.microbatches, cfg.pp
    b = cfg.global_batch // (cfg.dp * cfg.ep * m)
    dp = DataParallel(cfg, model, hw)
    per = [(st, microbatch(cfg, model, hw, st, b, dp)) for st in distinct(cfg, model)]
    # the pipeline moves at its slowest rank's pace
    st, mb = max(per, key=lambda x: x[1].seconds)
    v = cfg.virtual_stages if p > 1 else 1
    busy = m * mb.seconds
    # fill and drain: (p - 1)/(m·v) of the busy time (Narayanan et al. 2021, section 2.2)
    bubble = busy * (p - 1) / (m * v) if p > 1 else 0.0
    comm = {d: m * t for d, t in mb.comm.items()}
    exposed = {d: m * t for d, t in mb.exposed.items()}
    key = (model, cfg.tp, cfg.cp, cfg.sequence_parallel, b, cfg.precision)
    # once a step: DDP's all-reduce behind the last backward, ZeRO-1/2's gather behind the forward,
    # FSDP under a pipeline (overlap.py)
    for dim, total, hidden in dp.per_step(st, phase(block_ops(*key), hw), m):
        comm[dim] = comm.get(dim, 0.0) + total
        exposed[dim] = exposed.get(dim, 0.0) + max(0.0, total - hidden)
    # AdamW and clipping stream their fp32 states: memory-bound, 40 bytes a local parameter
    # the optimizer's kernels at their measured pace (hw.optimizer_slowdown, stacks.py); FSDP's copies at theirs
    # (the roofline until measured in an FSDP step: hw.copy_slowdown)
    adam = dp.optimizer_elements(st) * OPTIMIZER_BYTES * hw.optimizer_slowdown
    optimizer = (adam + dp.copy_bytes(st, per_step=True) * hw.copy_slowdown) / (hw.hbm * hw.hbm_eff)
    total = m * mb.compute + bubble + optimizer + sum(exposed.values())
    # model FLOPs (PaLM's, recomputation not counted) per GPU
    flops = model_flops_per_token(model) * cfg.global_batch * model.seq / (world or cfg.world)
    parts = {k: m * x for k, x in mb.parts.items()}
    worst = max(exposed, key=exposed.get) if exposed else None
    dominant = "memory" if parts["memory-bound"] > parts["compute-bound"] else "compute"
    # a dim is named the bound only when its exposed time outweighs either side of the roofline
    if worst is not None and exposed[worst] > max(parts["memory-bound"], parts["compute-bound"]):
        dominant = worst
    # against the peak of the precision the matmuls run in (hardware.py: Hardware.peak): never above 100%
    mfu = flops / (total * peak)
    return StepTime(total, m * mb.compute, bubble, optimizer, comm, exposed, parts, flops, mfu, dominant)


def compute_floor(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, ac=None) -> float:
    """A lower bound on step_time's total: the slowest rank's blocks alone (no head, no
    communication, no optimizer), stretched by the bubble. The search skips a layout whose floor
    is above the slowest of the best it has. `ac`: the checkpointing to price (default the config's)."""
    b = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
    block = phase(block_ops(model, cfg.tp, cfg.cp, cfg.sequence_parallel, b, cfg.precision), hw)
    # the slowest rank's blocks alone: whatever its head or its messages cost, the step is longer
    layers = max(st.layers for st in distinct(cfg, model))
    m, v = cfg.microbatches, cfg.virtual_stages if cfg.pp > 1 else 1
    r = recomputation(cfg.checkpoint_activations if ac is None else ac)
    busy = m * layers * (block.forward + block.backward + block.recompute(r))
    # stretched by the bubble, (m·v + p - 1)/(m·v)
    return busy * (1 + (cfg.pp - 1) / (m * v))
