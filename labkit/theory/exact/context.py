"""Context parallelism (engines/parallel/context/, context/kinds.py), predicted: what a cp rank
sends per step for each cp_kind — the ring (Liu et al. 2023, zigzag layout), K/V all-gathered
(Llama 3) or Ulysses' all-to-alls (Jacobs et al. 2023). Activations need nothing of their own: a cp
rank keeps those of its s/cp tokens (theory/exact/activations.py). The derivation: DERIVATIONS.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.precision import ELEM
from labkit.layout.schedules import chunk_layers, style
from labkit.layout.window import rows_of, window_plan
from labkit.theory.exact import latent
from labkit.theory.exact.batch import microbatch_rows
from labkit.theory.exact.experts import moe_layers_held
from labkit.theory.exact.pipeline import stage_layers


def kv_message_bytes(cfg: ParallelConfig, model: ModelConfig, batch: int, act_bytes: int = 4) -> int:
    """One ring message: K and V of this rank's tokens, (2, b, nkv, s/cp, head_dim) with nkv the
    rank's KV heads: kv_heads/tp, or one (shared) when tp > kv_heads."""
    local_kv = max(1, model.n_kv_heads // cfg.tp)
    width = latent.kv_width(model, cfg.tp) if model.family.latent_attention else local_kv * model.head_dim
    return act_bytes * 2 * batch * (model.seq // cfg.cp) * width


def q_message_bytes(cfg: ParallelConfig, model: ModelConfig, batch: int, act_bytes: int = 4) -> int:
    """Ulysses' query (and output) message: (b, nh/tp, s/cp, head_dim) of this rank's tokens."""
    hd = latent.kernel_width(model) if model.family.latent_attention else model.head_dim  # MLA: padded heads
    return act_bytes * batch * (model.seq // cfg.cp) * (model.heads // cfg.tp) * hd


def _kind_rows(cfg: ParallelConfig, model: ModelConfig, micro: int, forwards: int) -> list[tuple[str, int, int, int]]:
    """(op, payload bytes, calls, group size) per attention pass (one layer, one microbatch) of cp_kind."""
    e = ELEM[cfg.precision]
    kv, dkv = kv_message_bytes(cfg, model, micro, e), kv_message_bytes(cfg, model, micro, 4)
    kind = cfg.context
    # hierarchical: the all-to-all over runs of cp_a2a ranks, the ring over the cp / cp_a2a runs; a
    # ring message is the run's tokens for the rank's nkv/cp_a2a heads, as many elements as its own K/V
    a2a, ring = (cfg.cp_a2a, cfg.cp // cfg.cp_a2a) if kind.hierarchical else (cfg.cp, cfg.cp)
    out = []
    if kind.splits_heads:  # q, K/V and the output each forward; their gradients (compute dtype) in backward
        q = q_message_bytes(cfg, model, micro, e)
        out += [("all_to_all", q, 2 * (forwards + 1), a2a), ("all_to_all", kv, forwards + 1, a2a)]
    if kind.ring:  # K/V in each forward and again in backward, then the dK/dV accumulators
        hops = ring - 1
        out += [(op, b, n * hops, ring) for op in ("send", "recv") for b, n in ((kv, forwards + 1), (dkv, 1))]
    if kind.gathers:  # every rank's K/V in each forward and again in backward; dK/dV home in fp32
        out += [("all_gather", cfg.cp * kv, forwards + 1, cfg.cp), ("reduce_scatter", cfg.cp * dkv, 1, cfg.cp)]
    return out


def _layer_indices(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> list[int]:
    """The blocks a pipeline rank holds (all of them without a pipeline)."""
    if cfg.pp == 1:
        return list(range(model.layers))
    p, v, placement = cfg.pp, cfg.virtual_stages, style(cfg.schedule)
    return [i for c in range(v) for i in chunk_layers(model.layers, p, v, pp_rank, c, cfg.stage_layers, placement)]


def _window_rows(comm, cfg, model, rank: int, label: str, cp_rank: int, window: int, micro: int, forwards: int):
    """One local layer's window exchange (labkit/layout/window.py), every microbatch: per peer one
    message of K/V rows forward (each forward: a recomputation sends them again) in the compute dtype,
    and their gradients back in backward, in the same dtype (autograd's, engines/parallel/context/window.py)."""
    row = kv_message_bytes(cfg, model, micro, ELEM[cfg.precision]) // (model.seq // cfg.cp)  # one row's K and V
    plan = window_plan(model.seq, cfg.cp, window)[cp_rank]
    sends = [rows_of(spans) for spans in plan["send"].values()]  # rows per peer message
    recvs = [rows_of(spans) for spans in plan["recv"].values()]
    # forward (every forward): K/V rows out to the peers that need them, in from those it needs;
    # backward: the received rows' gradients back out, the sent rows' gradients in
    for op, fwd, bwd in (("send", sends, recvs), ("recv", recvs, sends)):
        for r in fwd:
            comm.add(rank, label, op, row * r, cfg.cp, forwards * cfg.microbatches)
        for r in bwd:
            comm.add(rank, label, op, row * r, cfg.cp, cfg.microbatches)


def window_exchanged(cfg: ParallelConfig, model: ModelConfig) -> bool:
    """Whether a rank's bytes depend on its cp coordinate: sliding-window layers whose rows go by the
    window exchange (cp > 1, a kind other than Ulysses), each rank its own tails."""
    return cfg.cp > 1 and not cfg.context.splits_heads and any(model.layer_window(i) for i in range(model.layers))


def window_activation_bytes(cfg: ParallelConfig, model: ModelConfig, b: int, cp_rank: int, window: int) -> int:
    """What one local layer keeps beyond a global layer's count (b sequences, s/cp positions), by cp kind.
    Without cp: SDPA's (s, s) mask in the compute dtype (the CPU kernel makes the boolean mask additive).
    Ulysses: the same mask over the whole sequence, after its all-to-all. The window exchange
    (engines/parallel/context/window.py): each of the rank's two chunks saves its own keys and values
    (its rows and those received, cat'ed: e·2b·kv·keys) in place of the rank's k and v, its mask
    (c, keys), and the chunks' outputs cat'ed make wo's input a copy (e·b·(s/cp)·q, not a view)."""
    e, s = ELEM[cfg.precision], model.seq
    if cfg.cp == 1 or cfg.context.splits_heads:
        return e * s * s
    c = s // (2 * cfg.cp)
    kv = max(1, model.n_kv_heads // cfg.tp) * model.head_dim  # the rank's K (and V) width
    q = model.heads // cfg.tp * model.head_dim
    keys = [qc * c + c - max(0, qc * c - (window - 1)) for qc in (cp_rank, 2 * cfg.cp - 1 - cp_rank)]
    own_kv = e * 2 * b * (s // cfg.cp) * kv  # what a global layer's count has for k and v
    return sum(e * 2 * b * kv * n + e * c * n for n in keys) - own_kv + e * b * (s // cfg.cp) * q


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """What a cp rank sends for one step (per layer and microbatch: _kind_rows, by cp_kind) and
    the MoE balance-loss count all-reduce. The ring: cp-1 hops of K/V forward, cp-1 again backward
    and cp-1 of the dK/dV accumulators; all-gather: K/V gathered in forward and again in backward,
    dK/dV reduce-scattered; Ulysses: q, K/V and the output all-to-all'd in forward, their gradients
    in backward; hierarchical: Ulysses' all-to-alls over runs of cp_a2a ranks and the ring's hops
    across the cp / cp_a2a runs. With checkpoint_activations a block's forward (or, selective, its attention core)
    runs again in backward: its attention's collectives once more per layer (and, 'full', one more
    count all-reduce). K/V travel in the compute dtype, dK/dV in fp32 (the accumulation dtype of
    the ring and of the gathered kind); Ulysses' gradients in the compute dtype."""
    if cfg.cp == 1:
        return
    micro = microbatch_rows(cfg)
    forwards = 2 if cfg.recomputation.recomputes else 1  # every recomputation runs the ring again
    moe_forwards = 2 if cfg.recomputation.reruns_forward else 1  # selective leaves the MoE layer alone
    label = layout.label("cp")
    for rank in comm.ranks(layout):
        coords = layout.coords(rank)
        passes = stage_layers(cfg, model, coords["pp"])[0] * cfg.microbatches  # attention layers run
        windows = [model.layer_window(i) for i in _layer_indices(cfg, model, coords["pp"])]
        # a local layer's K/V go by the window exchange (ring, all-gather); Ulysses' all-to-alls are any layer's
        exchanged = [] if cfg.context.splits_heads else [w for w in windows if w is not None]
        for op, payload, calls, n in _kind_rows(cfg, model, micro, forwards):
            comm.add(rank, label, op, payload, n, calls * (passes - len(exchanged) * cfg.microbatches))
        for w in exchanged:
            _window_rows(comm, cfg, model, rank, label, coords["cp"], w, micro, forwards)
        if model.experts:  # per MoE layer (not the first dense_layers) and microbatch
            moe_passes = moe_layers_held(cfg, model, coords["pp"]) * cfg.microbatches
            comm.add(rank, label, "all_reduce", 8 * micro * model.experts, cfg.cp, moe_forwards * moe_passes)
