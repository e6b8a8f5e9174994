"""The mixture-of-experts MLP: softmax router, top-k, dropless, with a load-balancing loss.

Each token goes to the k experts with the highest router probability and its output is their
outputs weighted by those probabilities, y = sum_{e in topk} p_e(x) E_e(x) (Switch Transformer,
Fedus et al. 2021, eq. 2; GShard's top-2, Lepikhin et al. 2020). Dropless, as in MegaBlocks
(Gale et al. 2022): no capacity factor, every token reaches all of its k experts, so the
computation does not depend on how tokens are spread over ranks and expert parallelism
changes nothing.

The assignments (token, slot) are sorted by expert, so each expert multiplies one contiguous
block of rows; `dispatch(moe, rows, counts)` runs the experts on them. Locally that is a loop
over the experts; expert parallelism (engines/parallel/experts.py) swaps in an all-to-all to
the ranks that hold them and back.

Two kinds of expert (ModelConfig.arch). gpt, gpt2: GELU experts (gpt2's tanh GELU), w2(GELU(w1 x)),
gates the top-k softmax probabilities as they are (Switch, GShard). llama (Mixtral, Jiang et al. 2024, section 2.1):
SwiGLU experts, w2(SiLU(w1 x) * w3 x), and gates renormalised over the chosen k — the softmax
of the top-k logits, as Mixtral's router computes them (HF MixtralSparseMoeBlock: softmax,
top-k, divide by their sum).

Fine-grained MoE (Qwen3-MoE, DeepSeek-V3; ModelConfig.moe_ffn ... bias_update_speed): experts of
their own width f = moe_ffn; gates renormalised or not (norm_topk_prob; HF Qwen3MoeTopKRouter);
DeepSeek-V3's router (technical report arXiv:2412.19437, section 2.1.2, eqs. 12-16; HF
modeling_deepseek_v3.py DeepseekV3TopkRouter, transformers 5.24): sigmoid affinities s, chosen by
s + b with b the aux-loss-free bias (a buffer, no gradient), gates taken from s alone; group-limited
routing (section 2.1.2 "node-limited routing", HF n_group / topk_group): a group scores the sum of its
two best s + b, the top topk_group groups stay, the others are masked to -inf; the gates scaled by
routed_scaling_factor; shared experts (DeepSeekMoE, Dai et al. 2024, eq. 3) a dense MLP of width
shared_experts * f added to the routed output, as HF DeepseekV3MoE adds it. The routing's per-expert
loads are summed in `loads` for `update_expert_bias` (after each step, from the global batch).

Parameters, as labkit/theory/exact/model.py lists them: w1 (E, h, f), w2 (E, f, h), [w3 (E, h, f),]
router.weight (E, h), [shared.* (the dense MLP of width shared_experts * f)].
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig
from labkit.engines.layers import MLP, SwiGLU

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
"""GPT-OSS's clamped SwiGLU: g σ(1.702 g) with g <= 7 and |up| <= 7 (transformers GptOssConfig swiglu_alpha,
swiglu_limit; OpenAI's gpt_oss/torch/model.py `swiglu`); from_hf refuses other values."""


def local_experts(moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: rows (N, h) sorted by expert, counts (E,) -> (N, h)."""
    blocks = rows.split(counts.tolist())  # E x (n_e, h), views
    return torch.cat([moe.expert(e, x) for e, x in enumerate(blocks)])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        """The block's index in the whole model (the route log and the reference's replay name it)."""
        e, h, f = cfg.experts, cfg.hidden, cfg.expert_ffn
        clamped = cfg.family.clamped_experts  # GPT-OSS: biases on the router and every expert projection
        self.router = nn.Linear(h, e, bias=clamped)
        self.w1 = nn.Parameter(torch.empty(e, h, f))  # gpt: fc1; llama: the gate
        self.w2 = nn.Parameter(torch.empty(e, f, h))  # the down projection
        self.w3 = nn.Parameter(torch.empty(e, h, f)) if cfg.family.gated_mlp else None  # llama: the up projection
        self.w1_bias = nn.Parameter(torch.zeros(e, f)) if clamped else None  # HF gate_up_proj_bias[:, ::2]
        self.w3_bias = nn.Parameter(torch.zeros(e, f)) if clamped else None  # HF gate_up_proj_bias[:, 1::2]
        self.w2_bias = nn.Parameter(torch.zeros(e, h)) if clamped else None  # HF down_proj_bias
        self.approximate = cfg.family.gelu_approximate
        dense = SwiGLU if cfg.family.gated_mlp else MLP
        self.shared = dense(cfg.replace(ffn=f * cfg.shared_experts)) if cfg.shared_experts else None
        """The shared experts: one dense MLP every token passes (HF DeepseekV3MoE.shared_experts)."""
        # b of DeepSeek-V3's eq. 16: fp32, no gradient, saved with the model (HF e_score_correction_bias)
        self.register_buffer("expert_bias", torch.zeros(e) if cfg.sigmoid_router else None)
        self.loads = torch.zeros(e, dtype=torch.int64)
        """Assignments per expert since the last bias update (this rank's tokens; update_expert_bias sums them)."""
        self.counting = True
        """Whether a forward adds to `loads`: off while activation checkpointing reruns it (checkpoint.py)."""
        self.dispatch = local_experts
        """(moe, rows, counts) -> outputs; expert parallelism swaps in its all-to-all."""
        self.seq_split = (None, 1)
        """(group, n): a sequence is split over the n ranks of `group` (context parallelism)."""
        self.aux_loss = None
        """The load-balancing loss of the last forward (engines/model.py aux_loss collects it)."""
        self.route_log = None
        """A run's engines/routes.py RouteLog: the experts each forward chose, for the oracle."""
        self.follow = None
        """The reference's replay of a run's choices (labkit/oracle/replay.py): (own choice, scores
        before and after the most favourable perturbation) -> the experts to use."""

    def _apply(self, fn, recurse=True):
        """Casts and moves as nn.Module does, but the bias stays fp32 (a bf16 compute copy too): its
        updates of γ = 0.001 would round away in bf16's 8 bits (DeepSeek-V3 keeps it in fp32 as well)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of the ones this rank holds: a GELU MLP, or SwiGLU (llama). (n, h) -> (n, f) -> (n, h)."""
        if self.w3 is None:  # gpt2's experts use its tanh GELU
            return F.gelu(x @ self.w1[e], approximate=self.approximate) @ self.w2[e]
        if self.w1_bias is not None:  # GPT-OSS's clamped SwiGLU (transformers GptOssExperts._apply_gate)
            gate = (x @ self.w1[e] + self.w1_bias[e]).clamp(max=SWIGLU_LIMIT)  # (n, f)
            up = (x @ self.w3[e] + self.w3_bias[e]).clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
            return ((up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)) @ self.w2[e] + self.w2_bias[e]
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        cfg, k = self.cfg, self.cfg.top_k
        gate, expert, probs = self.route(self.router(x).float(), x)  # (b, s, k) twice, (b, s, E)
        if self.route_log is not None and self.counting:  # not when checkpointing reruns the forward
            self.route_log.record(self.layer, expert)
        self.aux_loss = self.balance_loss(probs, expert)
        flat = expert.reshape(-1)  # (b*s*k,): assignment a = token*k + slot
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=cfg.experts)  # (E,)
        if self.counting:
            self.loads = self.loads.to(counts.device) + counts
        rows = x.reshape(b * s, h)[order // k]  # (b*s, h) -> (b*s*k, h), sorted by expert
        out = self.dispatch(self, rows, counts)  # (b*s*k, h), sorted by expert
        out = out[order.argsort()].view(b * s, k, h)  # back to (token, slot) order
        y = (out * gate.view(b * s, k, 1).to(out.dtype)).sum(dim=1)  # sum_e p_e(x) E_e(x): (b*s, h)
        y = y.view(b, s, h)
        return y if self.shared is None else y + self.shared(x)  # DeepSeekMoE eq. 3: shared + routed

    def route(self, logits: torch.Tensor, x: torch.Tensor | None = None):
        """logits (b, s, E) fp32 -> (gates (b, s, k), experts (b, s, k), the probabilities the balance loss
        averages (b, s, E)). Softmax: top-k of the softmax (Switch; Mixtral, Qwen3-MoE renormalise).
        Sigmoid (DeepSeek-V3 eqs. 13-16): chosen by s + b within the topk_group best groups, gated by s.
        `x`: the router's input, which the reference's replay (`follow`) bounds the logits' error by."""
        cfg, k = self.cfg, self.cfg.top_k
        if cfg.family.clamped_experts:  # GPT-OSS (GptOssTopKRouter): top-k of the logits, softmax over those k
            top, expert = logits.topk(k, dim=-1)  # (b, s, k) each
            followed = self._followed(x, logits, expert)
            if followed is not None:  # the gates of the run's experts: the same tensors, gathered
                top, expert = logits.gather(-1, followed), followed
            return top.softmax(dim=-1), expert, logits.softmax(dim=-1)
        probs, choice = self._scores(logits)
        if choice is probs:
            gate, expert = probs.topk(k, dim=-1)  # (b, s, k) each
        else:
            expert = choice.topk(k, dim=-1)[1]  # (b, s, k)
            gate = probs.gather(-1, expert)  # the chosen experts' s, without the bias
        followed = self._followed(x, logits, expert)
        if followed is not None:
            gate, expert = probs.gather(-1, followed), followed
        if cfg.renormalises_gates:
            # Mixtral, Qwen3-MoE: the softmax of the top-k logits; DeepSeek-V3 eq. 13 (HF's + 1e-20)
            gate = gate / (gate.sum(dim=-1, keepdim=True) + 1e-20) if cfg.sigmoid_router else gate / gate.sum(-1, True)
        if cfg.routed_scaling_factor != 1.0:
            gate = gate * cfg.routed_scaling_factor
        if cfg.sigmoid_router:  # the balance loss's s' (DeepSeek-V3 eq. 19): affinities normalised over E
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return gate, expert, probs

    def _scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the probabilities the gates take, the scores the top-k chooses by) (b, s, E) each: the softmax
        twice over, or the sigmoid and the sigmoid plus the bias; outside the topk_group best groups -inf."""
        cfg = self.cfg
        if not cfg.sigmoid_router:
            probs = logits.softmax(dim=-1)  # (b, s, E)
            choice = probs
        else:
            probs = logits.sigmoid()  # s_{i,t}, eq. 15
            choice = probs + self.expert_bias  # s + b: for the choice only (eq. 16)
        if cfg.n_group > 1:  # group-limited: a group scores its best two s + b (HF DeepseekV3TopkRouter)
            e, g = cfg.experts, cfg.n_group
            grouped = choice.unflatten(-1, (g, e // g))  # (b, s, G, E/G)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(cfg.topk_group, dim=-1)[1]  # (b, s, topk_group)
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(-1, best, True)  # (b, s, G)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)  # (b, s, E)
        return probs, choice

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The k experts of each token (b, s, k), best first, as `route` chooses them: a function of the
        logits and the bias alone (the replay asks it of perturbed logits, labkit/oracle/replay.py)."""
        if self.cfg.family.clamped_experts:
            return logits.topk(self.cfg.top_k, dim=-1)[1]
        return self._scores(logits)[1].topk(self.cfg.top_k, dim=-1)[1]

    def _followed(self, x, logits, expert):
        """The run's experts where the reference's replay follows them (`follow`), else None: without the
        hook, a forward computes exactly what it did before there was one."""
        if self.follow is None:
            return None
        chosen = self.follow(self, x, logits, expert)
        return None if chosen is expert else chosen

    def balance_loss(self, probs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), per sequence:
        E * sum_e f_e P_e, with f_e the fraction of the sequence's s*k assignments routed to e
        and P_e the mean router probability of e over its tokens; then the mean over sequences.

        Per sequence rather than per batch, so that any split of the batch (data and expert
        parallelism, microbatches) averages to exactly the one-process value. Under context
        parallelism a sequence's tokens sit on cp ranks: its counts are summed over the cp
        group (no gradient flows through counts), and since P is a sum over tokens, each rank
        contributes cp * E * sum_e f_e P_e(its tokens); the shares, averaged over the cp ranks
        as every loss share is, give the whole. probs (b, s/cp, E), expert (b, s/cp, k)."""
        b, s_local, n_exp = probs.shape
        k = expert.shape[-1]
        group, cp = self.seq_split
        counts = torch.zeros(b, n_exp, dtype=torch.int64, device=probs.device)
        counts.scatter_add_(1, expert.reshape(b, -1), torch.ones_like(expert).reshape(b, -1))  # (b, E)
        if cp > 1:
            dist.all_reduce(counts, group=group)  # (b, E) over the whole sequence
        s = s_local * cp
        f = counts.to(probs.dtype) / (s * k)  # (b, E)
        p = probs.sum(dim=1) / s  # (b, s/cp, E) -> (b, E): this rank's part
        return cp * n_exp * (f * p).sum(dim=-1).mean()


@torch.no_grad()
def update_expert_bias(modules, group=None) -> None:
    """DeepSeek-V3's aux-loss-free balance (section 2.1.2): after a step, each expert's bias b moves by
    γ towards balance, from its load over the global batch: b += γ·sign(mean load - load), centred, as
    torchtitan applies it (torchtitan 2025, components/optimizer.py `_update_expert_bias`: the loads
    all-reduced over the data dims, delta - delta.mean()). `modules`: this rank's MoE layers (a pipeline
    stage's own); `group`: the ranks whose tokens make the global batch (dp x ep x cp), None on one process.
    Every rank of the group ends with the same bias: the loads are integers, summed exactly."""
    layers = [m for m in modules if isinstance(m, MoE) and m.expert_bias is not None and m.cfg.bias_update_speed > 0]
    if not layers:
        return
    loads = torch.stack([m.loads.to(m.expert_bias.device) for m in layers])  # (layers, E) int64
    if group is not None:
        dist.all_reduce(loads, group=group)  # (layers, E): the global batch's assignments
    for m, load in zip(layers, loads.float()):
        delta = m.cfg.bias_update_speed * torch.sign(load.mean() - load)  # (E,)
        m.expert_bias += delta - delta.mean()
        m.loads = torch.zeros_like(m.loads)
