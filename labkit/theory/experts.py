"""Mixture of experts and expert parallelism (engines/moe.py, engines/parallel/experts.py).

Parameters: each ep rank holds E/ep experts of every MoE layer (w1, w2 sliced along experts);
the router and every dense weight are replicas. Expert gradients are reduced over dp x cp,
the rest over dp x ep x cp (DDP buckets them per reduce group, engines/parallel/ddp.py).

Communication per MoE layer and microbatch on an ep rank with T tokens (b·s/cp) and N = T·k
assignments (dropless top-k, MegaBlocks-style):
  one all-to-all of the E per-expert counts (int64), so every rank knows its split sizes;
  dispatch  N·h elements out (forward), and the gradient of the combine, N·h (backward);
  combine   R·h back (forward) and the gradient of the dispatch, R·h (backward),
where R is how many assignments this rank's experts received. R depends on the router, step by
step; over an ep group the R's sum to the N's exactly, so the group's total is deterministic,
and per rank the formula below uses the balanced R = N. Ring model: all-to-all (ep-1)/ep · B.

Activations per MoE layer (what each op keeps for backward, like memory.activation_bytes):
  router probabilities 4·T·E (fp32 softmax output), the top-k expert ids (8·N int64) and gates
  (a·N: cast to the activation dtype for the weighted sum), the gathers' indices into and out of
  expert order (2 · 8·N int64), the balance loss's per-sequence fractions 4·b·E, and in the experts a·(R·h + 2·R·f) (input, GELU input
  and output) plus the returned rows a·N·h (kept by the gate multiply).
"""
from __future__ import annotations

from math import prod

from labkit.config import ModelConfig, ParallelConfig

EXPERT_WEIGHTS = ("mlp.w1", "mlp.w2")


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_WEIGHTS)


def local_shapes(cfg: ParallelConfig, model: ModelConfig, shapes: list) -> list:
    """(name, shape) of what one ep rank holds: experts split along their first dim."""
    return [(n, (s[0] // cfg.ep, *s[1:]) if is_expert(n) else s) for n, s in shapes]


def reduce_dims(name: str, cfg: ParallelConfig) -> tuple[str, ...]:
    """Mesh dims a parameter's gradient is summed over (engines/parallel/common.py `_lk_reduce`)."""
    return ("dp", "cp") if cfg.ep > 1 and is_expert(name) else ("dp", "ep", "cp")


def layer_activation_bytes(model: ModelConfig, batch: int, seq: int, act_bytes: int = 4,
                           received: int | None = None) -> int:
    """Bytes one MoE layer keeps for backward on a rank with `batch` sequences of `seq` tokens.
    `received`: rows this rank's experts got (R); default the balanced R = N, which is exact
    without expert parallelism (every rank runs every expert on its own N rows)."""
    t = batch * seq
    n = t * model.top_k
    r = n if received is None else received
    e, h, f = model.experts, model.hidden, model.ffn
    return 4 * t * e + 3 * 8 * n + 4 * batch * e + act_bytes * (n + n * h + r * h + 2 * r * f)


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """The all-to-alls of one step per ep rank (balanced routing, see the module docstring)."""
    if cfg.ep == 1 or not model.experts:
        return
    micro = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
    passes = model.layers // cfg.pp * cfg.microbatches
    rows = micro * (model.seq // cfg.cp) * model.top_k * model.hidden * (2 if cfg.precision == "bf16" else 4)
    forwards = 2 if cfg.checkpoint_activations else 1      # recomputation routes and dispatches again
    label = layout.label("ep")
    for rank in comm.ranks(layout):
        for _ in range(passes):
            comm.add(rank, label, "all_to_all", 8 * model.experts, cfg.ep, forwards)   # split sizes
            comm.add(rank, label, "all_to_all", rows, cfg.ep, 2 * forwards + 2)     # dispatch, combine, and back


def local_params(cfg: ParallelConfig, model: ModelConfig, shapes: list) -> int:
    return sum(prod(s) for _, s in local_shapes(cfg, model, shapes))
