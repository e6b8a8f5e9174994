"""Mixture of experts and expert parallelism, predicted (engines/moe.py, parallel/experts.py):
which experts an ep rank holds, the dims their gradients are reduced over, what an MoE layer
keeps for backward and its all-to-alls per step (dropless top-k, MegaBlocks-style; balanced
routing, R = N, where the real R depends on the router). The accounting: DERIVATIONS.md.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.mesh import DATA_DIMS
from labkit.layout.precision import ELEM
from labkit.layout.schedules import chunk_layers, style
from labkit.theory.exact.batch import microbatch_rows

EXPERT_WEIGHTS = ("mlp.w1", "mlp.w2", "mlp.w3")
EXPERT_DIMS = ("dp", "cp")
"""An expert's gradient is summed over dp x cp only: the ep ranks hold different experts."""


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_WEIGHTS)


def local_shapes(cfg: ParallelConfig, model: ModelConfig, shapes: list) -> list:
    """(name, shape) of what one ep rank holds: experts split along their first dim."""
    return [(n, (s[0] // cfg.ep, *s[1:]) if is_expert(n) else s) for n, s in shapes]


def reduce_dims(name: str, cfg: ParallelConfig) -> tuple[str, ...]:
    """Mesh dims a parameter's gradient is summed over (engines/parallel/common.py `ParamMeta.reduce`)."""
    return EXPERT_DIMS if cfg.ep > 1 and is_expert(name) else DATA_DIMS


def layer_activation_bytes(
    model: ModelConfig, batch: int, seq: int, act_bytes: int = 4, received: int | None = None
) -> int:
    """Bytes one MoE layer keeps for backward on a rank with `batch` sequences of `seq` tokens:
    with T = b·s tokens, N = T·k assignments and R rows received by this rank's experts,
    4·T·E (router probabilities, fp32) + 3·8·N (top-k ids, the two gathers' indices, int64)
    + 4·b·E (balance-loss fractions) + a·(N + N·h + R·h + 2·R·f) (gates, returned rows, and in
    the experts their input, GELU input and output). llama (Mixtral): SwiGLU experts keep 4·R·f
    (gate out, SiLU out, up out, product), and renormalising the top-k gates keeps them and their
    sum in fp32, 4·(N + T). `received`: R; default the balanced R = N, which is exact without
    expert parallelism (every rank runs every expert on its own N rows)."""
    t = batch * seq
    n = t * model.top_k
    r = n if received is None else received
    e, h, f = model.experts, model.hidden, model.ffn
    out = 4 * t * e + 3 * 8 * n + 4 * batch * e + act_bytes * (n + n * h + r * h + 2 * r * f)
    if model.family.gated_mlp:  # and the top-k gates renormalised in fp32 (Mixtral)
        out += act_bytes * 2 * r * f + 4 * (n + t)
    return out


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """The all-to-alls of one step per ep rank (balanced routing): per MoE layer and microbatch
    one of the E split sizes (int64), then the dispatch and the combine, each N·h elements
    forward and again backward; recomputation routes and dispatches once more."""
    if cfg.ep == 1 or not model.experts:
        return
    v, placement = cfg.virtual_stages if cfg.pp > 1 else 1, style(cfg.schedule)
    rows = microbatch_rows(cfg) * (model.seq // cfg.cp) * model.top_k * model.hidden * ELEM[cfg.precision]
    forwards = 2 if cfg.recomputation.reruns_forward else 1
    label = layout.label("ep")
    for rank in comm.ranks(layout):
        pp_rank = layout.coords(rank)["pp"]
        held = [chunk_layers(model.layers, cfg.pp, v, pp_rank, c, cfg.stage_layers, placement) for c in range(v)]
        layers = sum(len(blocks) for blocks in held)
        for _ in range(layers * cfg.microbatches):
            comm.add(rank, label, "all_to_all", 8 * model.experts, cfg.ep, forwards)  # split sizes
            comm.add(rank, label, "all_to_all", rows, cfg.ep, 2 * forwards + 2)  # dispatch, combine, and back
