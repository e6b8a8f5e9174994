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

EXPERT_WEIGHTS = ("mlp.w1", "mlp.w2", "mlp.w3", "mlp.w1_bias", "mlp.w2_bias", "mlp.w3_bias")
"""Each expert's own tensors, split over ep along their first dim (GPT-OSS's biases with their experts)."""
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
    expert parallelism (every rank runs every expert on its own N rows).
    Fine-grained MoE (engines/moe.py; measured by tests/test_moe_fine.py): f is an expert's width
    (moe_ffn); the top-k renormalisation's 4·(N + T) wherever gates are renormalised (norm_topk_prob);
    a sigmoid router keeps one more fp32 sum per token, 4·T (the affinities normalised for the balance
    loss, DeepSeek-V3 eq. 19); GPT-OSS's clamped SwiGLU keeps a·7·R·f and its top-k softmax 4·N below fp32;
    shared experts keep a dense MLP's a·(4 or 2)·T·f_s on every token
    (f_s = shared_experts·f); group limits and routed_scaling_factor keep nothing more."""
    t = batch * seq
    n = t * model.top_k
    r = n if received is None else received
    e, h, f = model.experts, model.hidden, model.expert_ffn
    out = 4 * t * e + 3 * 8 * n + 4 * batch * e + act_bytes * (n + n * h + r * h + 2 * r * f)
    if model.family.gated_mlp:  # SwiGLU experts: gate out, SiLU out, up out, product
        out += act_bytes * 2 * r * f
    if model.family.clamped_experts:
        # GPT-OSS: the clamped SwiGLU keeps 3·R·f more, 7 in all (both clamps' inputs, the clamped gate g,
        # σ(1.702 g), g σ, up + 1, and (up + 1) · g σ, down's input); the softmax over the top-k logits keeps
        # its fp32 output, the gates counted above in fp32, a tensor of its own (4·N more) once cast narrower
        out += act_bytes * 3 * r * f + (4 * n if act_bytes != 4 else 0)
    elif model.renormalises_gates:  # the top-k gates renormalised in fp32 (Mixtral)
        out += 4 * (n + t)
    if model.sigmoid_router:
        out += 4 * t
    if model.shared_experts:  # a dense MLP of width shared_experts·f on all T tokens (memory.py's MLP row)
        out += act_bytes * (4 if model.family.gated_mlp else 2) * t * f * model.shared_experts
    return out


def moe_layers_held(cfg: ParallelConfig, model: ModelConfig, pp_rank: int) -> int:
    """MoE layers a rank at pipeline coordinate `pp_rank` holds (the first dense_layers blocks have none)."""
    if not model.experts:
        return 0
    v, placement = cfg.virtual_stages if cfg.pp > 1 else 1, style(cfg.schedule)
    held = [chunk_layers(model.layers, cfg.pp, v, pp_rank, c, cfg.stage_layers, placement) for c in range(v)]
    return sum(model.moe_layer(i) for blocks in held for i in blocks)


def bias_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """The aux-loss-free bias's one all-reduce a step (engines/moe.py `update_expert_bias`): each
    rank's (MoE layers held, E) int64 expert loads summed over the dp x ep x cp ranks whose tokens
    make the global batch (as torchtitan sums tokens_per_expert over dp x cp)."""
    if not (model.sigmoid_router and model.bias_update_speed > 0):
        return
    label, n = layout.label("dp", "ep", "cp"), cfg.dp * cfg.ep * cfg.cp
    for rank in comm.ranks(layout):
        layers = moe_layers_held(cfg, model, layout.coords(rank)["pp"])
        if layers:
            comm.add(rank, label, "all_reduce", 8 * layers * model.experts, n)


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """The all-to-alls of one step per ep rank (balanced routing): per MoE layer and microbatch
    one of the E split sizes (int64), then the dispatch and the combine, each N·h elements
    forward and again backward; recomputation routes and dispatches once more. With top-k over
    E experts a rank sends N = b·s·k rows whatever E is (dropless): 256 experts cost the wire no
    more than 8, only a longer split-size vector (8·E bytes)."""
    bias_rows(comm, cfg, model, layout)
    if cfg.ep == 1 or not model.experts:
        return
    rows = microbatch_rows(cfg) * (model.seq // cfg.cp) * model.top_k * model.hidden * ELEM[cfg.precision]
    forwards = 2 if cfg.recomputation.reruns_forward else 1
    label = layout.label("ep")
    for rank in comm.ranks(layout):
        layers = moe_layers_held(cfg, model, layout.coords(rank)["pp"])
        for _ in range(layers * cfg.microbatches):
            comm.add(rank, label, "all_to_all", 8 * model.experts, cfg.ep, forwards)  # split sizes
            comm.add(rank, label, "all_to_all", rows, cfg.ep, 2 * forwards + 2)  # dispatch, combine, and back
