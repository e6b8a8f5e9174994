"""Context parallelism (ring attention, engines/parallel/context.py): what a rank sends and keeps.

Ring attention (Liu et al. 2023) over cp ranks, zigzag layout (each rank holds 2 of 2cp chunks).
Per layer and microbatch a rank sends one message per hop, each the K and V of its s/cp
tokens, 2·b·(s/cp)·(h/tp) elements:
  forward   cp-1 hops of K/V
  backward  cp-1 hops of K/V again, and cp-1 hops of the dK/dV accumulators (each block's
            accumulator starts at the first rank after its owner and arrives home at the last hop)
so 3(cp-1) sends of 2·b·s·h/cp elements: 6(cp-1)/cp · bsh per layer. K and V travel in the
compute dtype, the dK/dV accumulators in fp32 (the ring's accumulation dtype, whatever the
compute dtype: engines/parallel/context.py). (Gathering K/V instead,
as Llama 3's context parallelism does, sends the same 2(cp-1)/cp · bsh forward and reduce-
scatters 2(cp-1)/cp · bsh of dK/dV backward, but holds the whole sequence's K/V on every rank;
the ring sends K/V a second time in backward so that no rank ever holds more than two blocks.)
The cp ranks hold different tokens, so activations are those of one rank's s/cp tokens: the
memory formula with seq = s/cp (the saved log-sum-exp included), nothing else.
Under MoE the balance loss's per-sequence expert counts are summed over the cp group, one
all-reduce of b·E int64 per layer and microbatch (engines/moe.py).
"""
from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig


def local_model(cfg: ParallelConfig, model: ModelConfig) -> ModelConfig:
    """The model as one cp rank runs it: s/cp tokens of every sequence."""
    return model.replace(seq=model.seq // cfg.cp)


def kv_message_bytes(cfg: ParallelConfig, model: ModelConfig, batch: int, act_bytes: int = 4) -> int:
    """One ring message: K and V of this rank's tokens, (2, b, heads/tp, s/cp, head_dim)."""
    return act_bytes * 2 * batch * (model.seq // cfg.cp) * (model.hidden // cfg.tp)


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Ring sends/receives per rank for one step, and the MoE balance-loss count all-reduce.
    With checkpoint_activations a block's forward runs again in backward: one more K/V round
    and one more count all-reduce per layer. The message is in the compute dtype."""
    if cfg.cp == 1:
        return
    micro = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
    passes = model.layers // cfg.pp * cfg.microbatches        # attention layers run per step on a rank
    forwards = 2 if cfg.checkpoint_activations else 1
    kv = kv_message_bytes(cfg, model, micro, 2 if cfg.precision == "bf16" else 4)
    dkv = kv_message_bytes(cfg, model, micro, 4)
    label = layout.label("cp")
    for rank in comm.ranks(layout):
        for op in ("send", "recv"):   # K/V in each forward and again in backward, then dK/dV
            comm.add(rank, label, op, kv, cfg.cp, (forwards + 1) * (cfg.cp - 1) * passes)
            comm.add(rank, label, op, dkv, cfg.cp, (cfg.cp - 1) * passes)
        if model.experts:
            comm.add(rank, label, "all_reduce", 8 * micro * model.experts, cfg.cp, forwards * passes)
