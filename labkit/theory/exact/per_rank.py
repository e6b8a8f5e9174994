"""The per-rank roll-up: every strategy's rules gathered into what one rank holds (`rank_memory`)
and what it sends in one step (`comm_rows`, `rank_comm`). The rules live below, one module per
strategy; `theory.estimate` and the ScaleExplorer read these.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.theory.exact import activations, context, experts, muon, pipeline, sharding, tensor
from labkit.theory.exact.comm import Comm


def rank_memory(cfg: ParallelConfig, model: ModelConfig, layout, rank: int, optim=None) -> dict[str, int]:
    """Predicted bytes on one rank: params, grads, optimizer (persistent, after a step),
    activations (peak saved for backward), the transients a strategy tracks beside them
    (ZeRO-3's 'gathered' parameters, 'reduce_buffers') and peak (their sum on the CPU, as if
    the transients peaked together: an upper bound).

    Every strategy contributes its rule: which parameters the rank holds (theory/exact/params.py:
    pipeline chunks, E/ep experts, TP slices), how their states are sharded and in what dtype
    (theory/exact/sharding.py: DDP, ZeRO, FSDP, precision), and what its microbatches keep for
    backward (theory/exact/activations.py: TP/SP, CP, MoE, checkpointing, the schedule's microbatches
    in flight)."""
    coords = layout.coords(rank)
    # FSDP2's uneven rows depend on the dp index (within the shard group under HSDP: shard inside)
    index = coords["dp"] % sharding.dp_shard(cfg) if cfg.torch_impl else 0
    # sliding windows under cp: each cp rank's chunks see their own number of keys (context.py)
    cp_rank = coords["cp"] if context.window_exchanged(cfg, model) else 0
    indices = None  # Muon's state on a sharded slice depends on which pieces the slice holds (sharding.state_bytes)
    if optim is not None and optim.kind.muon and cfg.sharded.optimizer and not cfg.torch_impl:
        buffers = sharding.flat_buffers(cfg, model, None, coords["pp"])
        indices = tuple(layout.group_of(rank, *p.dims).index(rank) for p in buffers)
    return dict(_rank_memory(cfg, model, coords["pp"], index, cp_rank, optim, indices))


@lru_cache(maxsize=4096)
def _rank_memory(
    cfg: ParallelConfig, model: ModelConfig, pp_rank: int, index: int, cp_rank: int = 0, optim=None, indices=None
) -> tuple:
    """rank_memory of every rank at pipeline coordinate `pp_rank` (and FSDP2 data index `index`):
    the rest of a rank's coordinates change nothing, so an estimate at scale computes this once
    per coordinate."""
    out = sharding.state_bytes(cfg, model, None, index, pp_rank, optim, indices)
    out["activations"] = activations.peak(cfg, model, pp_rank, cp_rank=cp_rank)
    if cfg.pp > 1 and cfg.pipeline.splits_backward and not cfg.torch_impl:  # what our B keeps for W
        out["held_for_w"] = pipeline.held_peak(cfg, model, pp_rank)
    out.update(sharding.transient_peaks(cfg, model, None, pp_rank))
    out["peak"] = sum(out.values())
    # a tuple, not the dict: callers get a fresh dict each (rank_memory), never the cached value
    return tuple(out.items())


def comm_rows(comm: Comm, cfg: ParallelConfig, model: ModelConfig, layout, optim=None) -> None:
    """Every collective of one steady-state step of `cfg`, per rank of `comm.ranks(layout)`, with
    the op names, dims and ring-model wire bytes the comm meter records. Each strategy adds its
    own ops (tensor.py, context.py, experts.py, pipeline.py, sharding.py: DDP / ZeRO / FSDP and
    the global norm)."""
    tensor.comm_rows(comm, cfg, model, layout)
    context.comm_rows(comm, cfg, model, layout)
    experts.comm_rows(comm, cfg, model, layout)
    pipeline.p2p_rows(comm, cfg, model, layout)
    pipeline.tied_rows(comm, cfg, model, layout)
    sharding.comm_rows(comm, cfg, model, layout, optim)  # with Distributed Muon's gathers
    muon.comm_rows(comm, cfg, model, layout, optim)  # OptimConfig name='muon': a tp rank's gathers


def rank_comm(
    cfg: ParallelConfig, model: ModelConfig, layout, ranks, stop: Callable[[], bool] | None = None, optim=None
) -> dict[int, list[dict]]:
    """The comm rows {rank, dim, op, calls, payload_bytes, wire_bytes} of one step of each rank in
    `ranks`, and of those ranks only (the theory's loops skip the others). `stop`: see Comm; the
    walk raises theory.Stopped once it returns True."""
    # a rank asked twice is filled once
    comm = Comm(only=sorted(set(ranks)), stop=stop)
    comm_rows(comm, cfg, model, layout, optim)
    out: dict[int, list[dict]] = {r: [] for r in comm.only}
    for row in comm.table():
        out[row["rank"]].append(row)
    return out
