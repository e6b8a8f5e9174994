"""Context parallelism (ring attention, engines/parallel/context.py), predicted: what a cp rank
sends per step (Liu et al. 2023, zigzag layout). Activations need nothing of their own: a cp
rank keeps those of its s/cp tokens (theory/exact/activations.py). The derivation: DERIVATIONS.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.precision import ELEM
from labkit.theory.exact.batch import microbatch_rows
from labkit.theory.exact.pipeline import stage_layers


def kv_message_bytes(cfg: ParallelConfig, model: ModelConfig, batch: int, act_bytes: int = 4) -> int:
    """One ring message: K and V of this rank's tokens, (2, b, nkv, s/cp, head_dim) with nkv the
    rank's KV heads: kv_heads/tp, or one (shared) when tp > kv_heads."""
    local_kv = max(1, model.n_kv_heads // cfg.tp)
    return act_bytes * 2 * batch * (model.seq // cfg.cp) * local_kv * model.head_dim


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Ring sends/receives per rank for one step — per layer and microbatch cp-1 hops of K/V
    forward, cp-1 again backward and cp-1 of the dK/dV accumulators — and the MoE balance-loss
    count all-reduce. With checkpoint_activations a block's forward (or, selective, its attention
    core) runs again in backward: one more K/V round per layer (and, 'full', one more count
    all-reduce). K/V travel in the compute dtype,
    dK/dV in fp32 (the ring's accumulation dtype)."""
    if cfg.cp == 1:
        return
    micro = microbatch_rows(cfg)
    forwards = 2 if cfg.recomputation.recomputes else 1  # every recomputation runs the ring again
    moe_forwards = 2 if cfg.recomputation.reruns_forward else 1  # selective leaves the MoE layer alone
    kv = kv_message_bytes(cfg, model, micro, ELEM[cfg.precision])
    dkv = kv_message_bytes(cfg, model, micro, 4)
    label = layout.label("cp")
    for rank in comm.ranks(layout):
        passes = stage_layers(cfg, model, layout.coords(rank)["pp"])[0] * cfg.microbatches  # attention layers run
        for op in ("send", "recv"):  # K/V in each forward and again in backward, then dK/dV
            comm.add(rank, label, op, kv, cfg.cp, (forwards + 1) * (cfg.cp - 1) * passes)
            comm.add(rank, label, op, dkv, cfg.cp, (cfg.cp - 1) * passes)
        if model.experts:
            comm.add(rank, label, "all_reduce", 8 * micro * model.experts, cfg.cp, moe_forwards * passes)
