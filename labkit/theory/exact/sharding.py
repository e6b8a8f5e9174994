"""Data parallelism, predicted per rank: DDP, ZeRO-1/2/3 and FSDP under either precision —
model-state bytes after a step, the transients they track (gathered parameters, reduce
buffers), and their collectives per step. The accounting is the ZeRO paper's (Rajbhandari et
al., SC 2020, section 5 and figure 1; section 7 for the traffic: DDP and ZeRO-1/2 2Ψ(N-1)/N,
ZeRO-3 / FSDP 3Ψ(N-1)/N), here exactly as the lab lays its flat buffers out
(labkit/layout/flat.py); PyTorch's FSDP2 pads each parameter on dim 0 instead. Under pipeline
parallelism ZeRO-2/3 and FSDP reduce once per step and ZeRO-3 / FSDP keep a stage gathered over
it (engines/parallel/zero.py, zero3.py; torchtitan's composition): one all-gather and one
reduce-scatter per buffer and step, the transients replayed along the schedule (`keep_peaks`).
DERIVATIONS.md derives every case.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.buckets import grouped_buckets, torch_ddp_buckets
from labkit.layout.flat import FlatLayout, bucket_layouts, unit_kind, unit_layouts, unit_of
from labkit.layout.mesh import DATA_DIMS, shard_dims
from labkit.layout.precision import ELEM, REDUCE
from labkit.layout.schedules import schedule_table, stage_of, style
from labkit.theory.exact.float8 import amax_rows, gather_elem, gathered_fp8
from labkit.theory.exact.muon import GATHER, STATE, muon_names, state_per_element
from labkit.theory.exact.params import chunk_local_params, rank_entries


def dp_shard(cfg: ParallelConfig) -> int:
    """The ranks of one HSDP shard group, dp / dp_replicate (dp itself without HSDP)."""
    return cfg.dp // cfg.dp_replicate


def group_size(cfg: ParallelConfig, dims) -> int:
    subs = {"dp_shard": dp_shard(cfg), "dp_replicate": cfg.dp_replicate}  # HSDP's halves of dp
    return prod(subs[d] if d in subs else getattr(cfg, d) for d in dims)


def flat_buffers(cfg: ParallelConfig, model: ModelConfig, n: int | None = None, pp_rank: int = 0) -> list[FlatLayout]:
    """The flat buffers of our ZeRO / FSDP on a rank at pipeline coordinate `pp_rank` (the
    engines build the same ones). n: one group size for every buffer (data parallelism alone);
    default each buffer's own reduce group."""
    return list(_flat_buffers(cfg, model, n, pp_rank))


@lru_cache(maxsize=4096)
def _flat_buffers(cfg: ParallelConfig, model: ModelConfig, n: int | None, pp_rank: int) -> tuple[FlatLayout, ...]:
    # each buffer sharded over its reduce dims, dp's shard sub-dim in dp's place under HSDP (shards.entries)
    entries = [(a, s, shard_dims(d, cfg.dp_replicate > 1), c) for a, s, d, c in rank_entries(cfg, model, pp_rank)]
    sizes = n if n is not None else {d: group_size(cfg, d) for _, _, d, _ in entries}
    if cfg.sharded.optimizer and not cfg.sharded.params:  # ZeRO-1 / 2: DDP's buckets, flat
        return tuple(bucket_layouts(entries, sizes, int(cfg.bucket_mb * 2**20), ELEM[cfg.precision]))
    kind = unit_kind(cfg.sharded.per_module_units, model.tied)
    return tuple(unit_layouts(entries, sizes, kind, gathered_fp8(cfg, model)))


def fsdp2_rows(d0: int, n: int, index: int) -> tuple[int, int]:
    """FSDP2's Shard(0): (padded rows every rank stores, rows rank `index` really holds)."""
    chunk = -(-d0 // n)
    return chunk, max(0, min(chunk, d0 - index * chunk))


def state_bytes(
    cfg: ParallelConfig,
    model: ModelConfig,
    n: int | None = None,
    index: int = 0,
    pp_rank: int = 0,
    optim=None,
    indices: tuple[int, ...] | None = None,
) -> dict[str, int]:
    """Bytes of params / grads / optimizer after a step on a rank at pipeline coordinate
    `pp_rank` and data index `index` (FSDP2's uneven rows depend on it). n: as in `flat_buffers`.
    `optim` (an OptimConfig): Muon's parameters keep one fp32 buffer, not Adam's two (theory/exact/muon.py);
    sharded, each on the real elements of its piece in the rank's slice, where AdamW keeps its moments over
    the rest of the slice, padding included (engines/muon.py ShardedMuon): `indices`, the rank's shard index
    in each flat buffer, says which pieces."""
    e, k = ELEM[cfg.precision], 8 + (4 if cfg.numerics.mixed else 0)  # + fp32 master weights
    entries = rank_entries(cfg, model, pp_rank)
    if not cfg.sharded.optimizer:
        psi = sum(prod(s) for _, s, _, _ in entries)
        muon, masters = muon_names(model, optim), k - 8
        states = sum(prod(s) * (masters + state_per_element(name, muon)) for name, s, _, _ in entries)
        return {"params": e * psi, "grads": e * psi, "optimizer": states}
    if cfg.sharded.fsdp and cfg.torch_impl:
        n_dp = n if n is not None else dp_shard(cfg)  # FSDP2 shards over dp (the shard group under HSDP)
        padded_local = held = 0
        for _, shape, _, _ in entries:  # TP-local tensors, dim 0 over dp
            chunk, rows = fsdp2_rows(shape[0], n_dp, index)
            rest = prod(shape[1:])
            padded_local += chunk * rest
            held += rows * rest
        # parameters and gradients are views of padded flat storage; Adam's moments are not
        return {"params": 4 * padded_local, "grads": 4 * padded_local, "optimizer": 8 * held}
    ps = flat_buffers(cfg, model, n, pp_rank)
    P, S = sum(p.padded for p in ps), sum(p.shard for p in ps)
    muon = muon_names(model, optim)
    held = 0  # Muon's elements in this rank's slices: 4 bytes of state, not Adam's 8
    for p, i in zip(ps, indices or [0] * len(ps)) if muon else ():
        held += sum(hi - lo for name, _, lo, hi, _ in p.pieces(i) if name in muon)
    return {  # a shard gathered in fp8 is held in fp8 (engines/parallel/zero3_float8.py)
        "params": sum(p.shard * gather_elem(cfg, p.fp8) for p in ps) if cfg.sharded.params else e * P,
        "grads": e * (S if cfg.sharded.grads else P),
        "optimizer": k * S - (STATE["adamw"] - STATE["muon"]) * held,
    }


def unit_sizes(cfg: ParallelConfig, model: ModelConfig, n: int | None = None, pp_rank: int = 0) -> dict[str, list]:
    """(gathered bytes, reduce-buffer bytes) of each unit's parts, units in forward order, a unit's
    parts in the order their reductions go. A module's buffers are gathered together; its fp8
    weights' buffer is reduced first, when its last gradient is in (the block's first layer, a norm,
    is in the other), then the rest, counted as one part (with several reduce groups, an upper bound
    on its reduce buffers: the engines reduce each buffer as soon as its own gradients are in).
    FSDP2: one part per unit."""
    if not cfg.torch_impl:
        out: dict[str, list] = {}
        for p in flat_buffers(cfg, model, n, pp_rank):
            parts = out.setdefault(p.unit, [[0, 0], [0, 0]])  # [fp8 weights, the rest]
            part = parts[0 if p.fp8 else 1]
            part[0] += p.padded * gather_elem(cfg, p.fp8)
            part[1] += p.padded * REDUCE
        return {u: [tuple(x) for x in parts if x[0]] for u, parts in out.items()}
    n_dp = n if n is not None else dp_shard(cfg)
    fp8 = gathered_fp8(cfg, model)
    sizes: dict[str, list] = {}
    for name, shape, _, _ in rank_entries(cfg, model, pp_rank):  # FSDP2: each parameter padded on dim 0
        numel = fsdp2_rows(shape[0], n_dp, 0)[0] * n_dp * prod(shape[1:])
        g, r = sizes.setdefault(unit_of(name, "fsdp"), [[0, 0]])[0]
        sizes[unit_of(name, "fsdp")][0] = [g + numel * gather_elem(cfg, name in fp8), r + numel * REDUCE]
    return {u: [tuple(sizes[u][0])] for u in sorted(sizes, key=lambda u: (u != "", len(u), u))}


def unit_peaks(size: dict[str, list], reshard: bool) -> dict[str, int]:
    """Peak bytes of gathered parameters and of unsharded gradient buffers for units, replaying
    the order in which ZeRO3's hooks act (engines/parallel/zero.py):
      forward   a unit is gathered just before it runs and freed after it (reshard) or kept;
                the root ('') is gathered around the whole forward;
      backward  when the gradient of a unit's output arrives the unit is gathered (if it was
                freed) and its gradient buffer allocated; when its last gradient is in, its
                parameters are freed and its reduce-scatter launched, after waiting for the one
                still in flight, whose buffer is then freed (one reduce-scatter in flight).
                The root's hook fires first (on the loss) and its gradients complete last.
                A unit of several buffers: each is freed and reduced in turn (`unit_sizes`).
    `size`: (gathered, reduce-buffer) bytes of each unit's buffers (unit_sizes); returns bytes."""
    blocks = [u for u in size if u != ""]
    root = [""] if "" in size else []
    gat = {u: sum(g for g, _ in parts) for u, parts in size.items()}
    live = peak = 0
    for u in root + blocks:  # forward
        live += gat[u]
        peak = max(peak, live)
        if reshard and u != "":
            live -= gat[u]
    if reshard:
        live -= sum(gat[u] for u in root)
    grads = gpeak = 0
    in_flight = 0  # the reduce buffer still in flight
    for u in root + blocks[::-1]:  # backward
        if reshard:
            live += gat[u]
            peak = max(peak, live)
        grads += sum(r for _, r in size[u])
        gpeak = max(gpeak, grads)
        if u == "":
            continue
        for g, r in size[u]:
            live -= g
            grads -= in_flight
            in_flight = r
    return {"gathered": peak, "reduce_buffers": gpeak}


def transient_peaks(cfg: ParallelConfig, model: ModelConfig, n: int | None = None, pp_rank: int = 0) -> dict[str, int]:
    """Peak bytes of the transients the engines track beside activations: 'gathered' parameters
    (ZeRO-3 / FSDP) and 'reduce_buffers', the full gradient buffers that exist for a reduction
    (ZeRO-2's buckets, ZeRO-3 / FSDP's units, and under bf16 the fp32 copies that DDP and ZeRO-1
    reduce). FSDP2 (impl='torch') has only its gathered parameters tracked. A ZeRO-3 / FSDP module's
    buffers are replayed as `unit_sizes` says."""
    if not cfg.sharded.optimizer:
        if not cfg.numerics.mixed or cfg.torch_impl:
            return {}
        # every bucket's fp32 copy (its microbatches' sum, with several) lives until finish();
        # with one microbatch, buckets whose group has one rank need none
        reduced = sum(
            prod(s)
            for _, s, d, _ in rank_entries(cfg, model, pp_rank)
            if cfg.microbatches > 1 or (n if n is not None else group_size(cfg, d)) > 1
        )
        return {"reduce_buffers": REDUCE * reduced} if reduced else {}
    if not cfg.sharded.params:  # ZeRO-1 / 2
        if not cfg.sharded.grads and not cfg.numerics.mixed:
            return {}  # ZeRO-1 in fp32: reduced in place
        once = not cfg.sharded.grads or cfg.pp > 1  # zero2 under a pipeline sums microbatches too
        if once and cfg.microbatches > 1:  # every bucket's fp32 sum from the first microbatch
            return {"reduce_buffers": REDUCE * sum(p.padded for p in flat_buffers(cfg, model, n, pp_rank))}
        # a buffer lives from its first gradient (zero2) or its launch (zero1) to the wait for its
        # reduce-scatter, one in flight: two neighbours at most, as backward fills them in order
        sizes = [p.padded * REDUCE for p in flat_buffers(cfg, model, n, pp_rank)]
        pairs = [a + b for a, b in zip(sizes, sizes[1:])]
        if cfg.microbatches > 1:
            # a microbatch's last bucket is waited for only when the next microbatch launches its
            # first: both ends of the list live at once (one bucket: two copies of it; measured
            # 268,800 B on TINY at dp 4, where the neighbours' rule said 134,400)
            pairs.append(sizes[0] + sizes[-1])
        return {"reduce_buffers": max(pairs or sizes)}
    if cfg.pp > 1 and not cfg.torch_impl:
        peaks = keep_peaks(cfg, model, n, pp_rank)
    else:
        peaks = unit_peaks(unit_sizes(cfg, model, n, pp_rank), cfg.reshards)
    if cfg.torch_impl:
        return {"gathered": peaks["gathered"]}
    return peaks


def keep_peaks(cfg: ParallelConfig, model: ModelConfig, n: int | None, pp_rank: int) -> dict[str, int]:
    """Peak bytes of gathered parameters and of gradient buffers of our ZeRO-3 / FSDP under a
    pipeline, replaying the rank's schedule as engines/parallel/zero3.py (`keep`) acts:
      F of a chunk    gathers each of its units not gathered yet (the root: once for all its chunks);
      a backward      (B, or W when backward is split) delivers a chunk's units' gradients, in
                      reverse forward order (W of a stage with an input: forward order, one weight
                      group after the other); a unit's buffer is made at its first gradient of the
                      step; once every microbatch's have arrived (in each chunk it spans) it is
                      freed and its reduce-scatter launched after waiting for the one in flight,
                      whose buffer then goes. A tied embedding's unit waits for the step's end.
    Every buffer of the rank is a unit here (one per reduce group of a module)."""
    p, v, m, placement = cfg.pp, cfg.virtual_stages, cfg.microbatches, style(cfg.schedule)
    entries = rank_entries(cfg, model, pp_rank)
    where = {name: (i, c) for i, (name, _, _, c) in enumerate(entries)}
    units = flat_buffers(cfg, model, n, pp_rank)
    chunks = [{where[x][1] for x in u.names} for u in units]
    first = [min(where[x][0] for x in u.names) for u in units]  # forward position
    tied = [model.tied and any(x == "embed.tok.weight" for x in u.names) and p > 1 for u in units]
    split = cfg.pipeline.splits_backward
    gathered, buffers, arrived = set(), set(), [dict.fromkeys(c, 0) for c in chunks]
    live = top = grads = gtop = 0
    in_flight = None

    def reduce(k: int) -> None:
        nonlocal live, grads, in_flight
        gathered.discard(k)
        live -= units[k].padded * gather_elem(cfg, units[k].fp8)
        if in_flight is not None:
            grads -= units[in_flight].padded * REDUCE
        in_flight = k

    for a in schedule_table(cfg.schedule, p, m, v).actions[pp_rank]:
        mine = [k for k in range(len(units)) if a.chunk in chunks[k]]
        if a.op == "F":
            for k in mine:
                if k not in gathered:
                    gathered.add(k)
                    live += units[k].padded * gather_elem(cfg, units[k].fp8)
                    top = max(top, live)
        elif a.op == ("W" if split else "B"):
            has_input = stage_of(pp_rank, a.chunk, p, placement) > 0
            for k in sorted(mine, key=lambda k: first[k], reverse=not (split and has_input)):
                if k not in buffers:
                    buffers.add(k)
                    grads += units[k].padded * REDUCE
                    gtop = max(gtop, grads)
                arrived[k][a.chunk] += 1
                if all(x == m for x in arrived[k].values()) and not tied[k]:
                    reduce(k)
    return {"gathered": top, "reduce_buffers": gtop}


def norm_dims(layout) -> tuple[str, ...]:
    """The dims of the global norm's all-reduce under sharding: every dim that splits parameters
    or shards their buffers (engines/parallel/common.py norm_terms, sharded); under HSDP the shard
    group's dp only (every replica holds the same shards and sums the same squares)."""
    dp = "dp_shard" if layout.size("dp_replicate") > 1 else "dp"
    return tuple(d for d in ("tp", "pp", "ep", dp, "cp") if layout.size(d) > 1)


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout, optim=None) -> None:
    """Every data-parallel collective of one step, per rank, in the order the engines issue them:
    DDP's buckets and then the global norm (sharding='none'); or ZeRO / FSDP's buffers, each over
    its own group (FlatLayout.dims), and the norm over `norm_dims`. Ranks at one pipeline
    coordinate issue the same ones, so they are listed once per coordinate."""
    if not cfg.sharded.optimizer:
        ddp_rows(comm, cfg, model, layout)
        grad_norm(comm, cfg, layout)
        return
    of_stage = torch_fsdp_ops if cfg.torch_impl else ops
    comm.per_stage(
        layout, lambda pp_rank: of_stage(cfg, model, layout, pp_rank) + muon_gathers(cfg, model, layout, pp_rank, optim)
    )


def muon_gathers(cfg: ParallelConfig, model: ModelConfig, layout, pp_rank: int, optim) -> list[tuple]:
    """Distributed Muon's gathers (engines/muon.py ShardedMuon), after the norm: each flat buffer that holds a
    Muon parameter all-gathers its slices' updates over its shard group once a step, in bf16."""
    muon = muon_names(model, optim)
    if not muon or cfg.torch_impl:
        return []
    return [
        (layout.label(*p.dims), "all_gather", p.padded * GATHER, p.n, 1)
        for p in flat_buffers(cfg, model, None, pp_rank)
        if any(name in muon for name in p.names)
    ]


def ddp_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """DDP (sharding='none'): each bucket of gradients all-reduced once per step over the dims its
    parameters are reduced over (dp x ep x cp; experts under ep: dp x cp; SP's LayerNorms add tp),
    bucketed per group and per pipeline chunk (the whole model when pp == 1), as
    engines/parallel/ddp.py `bucket_indices` does. Buckets are cut by gradient bytes in the compute dtype
    and reduced in fp32 (bf16 gradients go through an fp32 copy: engines/precision.py)."""
    elem = ELEM[cfg.precision]
    cap = int(cfg.bucket_mb * 2**20)

    def buckets(pp_rank: int):
        for chunk in chunk_local_params(cfg, model, pp_rank):
            numels = [prod(s) for _, s, _ in chunk]
            sizes = [k * elem for k in numels]
            if cfg.torch_impl:  # PyTorch's DDP: one process group
                groups = [(DATA_DIMS, b) for b in torch_ddp_buckets(sizes, cap)]
            else:
                groups = grouped_buckets(sizes, [dims for _, _, dims in chunk], cap)
            for dims, b in groups:
                yield layout.label(*dims), "all_reduce", REDUCE * sum(numels[i] for i in b), layout.size(*dims), 1

    comm.per_stage(layout, buckets)


def grad_norm(comm, cfg: ParallelConfig, layout) -> None:
    """DDP's global gradient norm (engines/parallel/common.py norm_terms): one fp32 scalar
    all-reduced over the dims that split the parameters (tp, pp, ep), in the optimizer phase."""
    split = tuple(d for d in ("tp", "pp", "ep") if layout.size(d) > 1)
    if not split:
        return
    for rank in comm.ranks(layout):
        comm.add(rank, layout.label(*split), "all_reduce", 4, layout.size(*split))


def ops(cfg: ParallelConfig, model: ModelConfig, layout, pp_rank: int) -> list[tuple]:
    """(dim, op, payload bytes, group size, calls) of our ZeRO / FSDP on one rank, one step."""
    e, m = ELEM[cfg.precision], cfg.microbatches
    norm = norm_dims(layout)
    the_norm = (layout.label(*norm), "all_reduce", 4, layout.size(*norm), 1)  # the global norm
    once = cfg.pp > 1  # under a pipeline: gathered once, reduced once per step (zero.py, zero3.py)
    out = []
    replicas = layout.label("dp_replicate"), cfg.dp_replicate  # HSDP's all-reduce across the shard groups
    buffers = flat_buffers(cfg, model, None, pp_rank)
    # under fp8 the fp8 buffers' amaxes, at the step's first gather: before any of its collectives
    out = amax_rows(buffers, layout)
    for p in buffers:
        dim = layout.label(*p.dims)
        if not cfg.sharded.params:  # ZeRO-1 / 2
            scatters = m if cfg.sharded.grads and not once else 1
            out.append((dim, "all_gather", p.padded * e, p.n, 1))
        else:  # gathered before its forward, and again before its backward unless kept (fp8: one byte)
            scatters = 1 if once else m
            calls = 1 if once else (2 if cfg.reshards else 1) * m
            out.append((dim, "all_gather", p.padded * gather_elem(cfg, p.fp8), p.n, calls))
        out.append((dim, "reduce_scatter", p.padded * REDUCE, p.n, scatters))
        if cfg.dp_replicate > 1:  # HSDP: each reduced shard (fp32) summed over the replicas (all_reduce_replicas)
            out.append((replicas[0], "all_reduce", p.shard * REDUCE, replicas[1], scatters))
    return out + [the_norm]


def torch_fsdp_ops(cfg: ParallelConfig, model: ModelConfig, layout, pp_rank: int) -> list[tuple]:
    """FSDP2 over dp: per unit and microbatch an all-gather before forward, another before
    backward (reshard_after_forward), a reduce-scatter of fp32 gradients; clip_grad_norm_ over
    its DTensor gradients all-reduces one fp32 per parameter tensor (each parameter's norm is a
    Partial DTensor; stacking them and taking the norm reduces them together)."""
    n, dim = dp_shard(cfg), layout.label("dp_shard" if cfg.dp_replicate > 1 else "dp")
    calls = (2 if cfg.reshard_after_forward else 1) * cfg.microbatches
    fp8 = gathered_fp8(cfg, model)  # their amaxes: one all-reduce a step (precompute_float8_dynamic_scale_for_fsdp)
    out = [(dim, "all_reduce", 4 * len(fp8), n, 1)] if fp8 else []
    for ((gathered, reduced),) in unit_sizes(cfg, model, n, pp_rank).values():
        out.append((dim, "all_gather", gathered, n, calls))  # an fp8 weight's rows at one byte each
        out.append((dim, "reduce_scatter", reduced, n, cfg.microbatches))
        if cfg.dp_replicate > 1:  # HSDP: FSDP2 all-reduces the reduce-scattered shard over its replicate mesh dim
            shard = reduced // n
            out.append((layout.label("dp_replicate"), "all_reduce", shard, cfg.dp_replicate, cfg.microbatches))
    return out + [(dim, "all_reduce", 4 * len(rank_entries(cfg, model, pp_rank)), n, 1)]
