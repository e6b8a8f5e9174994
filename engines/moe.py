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

Parameters, as labkit/theory/exact/model.py lists them: w1 (E, h, f), w2 (E, f, h), [w3 (E, h, f),]
router.weight (E, h).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.config import ModelConfig


def local_experts(moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Every expert on this rank: rows (N, h) sorted by expert, counts (E,) -> (N, h)."""
    blocks = rows.split(counts.tolist())  # E x (n_e, h), views
    return torch.cat([moe.expert(e, x) for e, x in enumerate(blocks)])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        e, h, f = cfg.experts, cfg.hidden, cfg.ffn
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, h, f))  # gpt: fc1; llama: the gate
        self.w2 = nn.Parameter(torch.empty(e, f, h))  # the down projection
        self.w3 = nn.Parameter(torch.empty(e, h, f)) if cfg.family.gated_mlp else None  # llama: the up projection
        self.approximate = cfg.family.gelu_approximate
        self.dispatch = local_experts
        """(moe, rows, counts) -> outputs; expert parallelism swaps in its all-to-all."""
        self.seq_split = (None, 1)
        """(group, n): a sequence is split over the n ranks of `group` (context parallelism)."""
        self.aux_loss = None
        """The load-balancing loss of the last forward (engines/model.py aux_loss collects it)."""

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of the ones this rank holds: a GELU MLP, or SwiGLU (llama). (n, h) -> (n, f) -> (n, h)."""
        if self.w3 is None:  # gpt2's experts use its tanh GELU
            return F.gelu(x @ self.w1[e], approximate=self.approximate) @ self.w2[e]
        return (F.silu(x @ self.w1[e]) * (x @ self.w3[e])) @ self.w2[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        k = self.cfg.top_k
        probs = self.router(x).float().softmax(dim=-1)  # (b, s, E)
        gate, expert = probs.topk(k, dim=-1)  # (b, s, k) each
        if self.w3 is not None:  # Mixtral: the softmax of the top-k logits
            gate = gate / gate.sum(dim=-1, keepdim=True)  # (b, s, k)
        self.aux_loss = self.balance_loss(probs, expert)
        flat = expert.reshape(-1)  # (b*s*k,): assignment a = token*k + slot
        order = flat.argsort(stable=True)  # assignments grouped by expert
        counts = torch.bincount(flat, minlength=self.cfg.experts)  # (E,)
        rows = x.reshape(b * s, h)[order // k]  # (b*s, h) -> (b*s*k, h), sorted by expert
        out = self.dispatch(self, rows, counts)  # (b*s*k, h), sorted by expert
        out = out[order.argsort()].view(b * s, k, h)  # back to (token, slot) order
        y = (out * gate.view(b * s, k, 1).to(out.dtype)).sum(dim=1)  # sum_e p_e(x) E_e(x): (b*s, h)
        return y.view(b, s, h)

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
