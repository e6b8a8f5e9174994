"""AdamW and global-norm gradient clipping, element-wise, for whole tensors or flat shards.

One formula serves the reference and every labkit strategy, so a ZeRO shard's update is
element for element the update of the full tensor. It follows torch.optim.AdamW
(Loshchilov & Hutter 2019, decoupled weight decay): p *= 1 - lr*wd; m = lerp(m, g, 1-b1);
v = b2*v + (1-b2)*g^2; p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labkit.config import OptimConfig


def decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices only (nanoGPT's rule): not on LayerNorm weights/biases.
    Embeddings are matrices and decay, as in nanoGPT."""
    return p.dim() >= 2


OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""The tensors of torch.optim.AdamW's and torch.optim.Muon's state that are the optimizer's bytes (its
`step` counters are not: labkit's theory counts neither side's)."""


def torch_adamw(names: list[str], params: list[torch.Tensor], cfg: OptimConfig, muon=None):
    """PyTorch's own AdamW with labkit's decay rule (two parameter groups): the optimizer of the
    impl="torch" strategies, whose parameters PyTorch owns (DDP, FSDP2, DTensor, pipelining). With
    OptimConfig name='muon', torch.optim.Muon for the parameters `muon(name, param)` says (the rule of
    labkit/layout/optimizer.py) beside it: the two stepped as one (`TorchOptimizers`)."""
    takes = [bool(muon and cfg.kind.muon and muon(n, p)) for n, p in zip(names, params)]
    decay = [p for n, p, m in zip(names, params, takes) if decays(n, p) and not m]
    rest = [p for n, p, m in zip(names, params, takes) if not decays(n, p) and not m]
    adam = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
    )
    if not any(takes):
        return adam
    muon_opt = torch.optim.Muon(
        [p for p, m in zip(params, takes) if m],
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.momentum,
        nesterov=cfg.nesterov,
        ns_steps=cfg.ns_steps,
        adjust_lr_fn=None if cfg.adjust_lr == "original" else cfg.adjust_lr,
    )
    return TorchOptimizers(adam, muon_opt)


class TorchOptimizers:
    """torch.optim.AdamW and torch.optim.Muon over disjoint parameters, stepped and zeroed together."""

    def __init__(self, *opts):
        self.opts = opts

    @property
    def state(self) -> dict:
        return {k: v for o in self.opts for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


class AdamW:
    """AdamW over a list of fp32 tensors (parameters or flat shards) with fp32 moments."""

    def __init__(self, params: list[torch.Tensor], cfg: OptimConfig, decay: list):
        self.params = params
        self.cfg = cfg
        self.decay = decay  # per tensor: bool, or a 0/1 float mask of the tensor's shape
        self.exp_avg = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], scale: float = 1.0) -> None:
        """One update; `scale` multiplies every gradient first (the clipping coefficient)."""
        c = self.cfg
        self.t += 1
        bc1 = 1 - c.beta1**self.t
        bc2_sqrt = math.sqrt(1 - c.beta2**self.t)
        for p, g, m, v, d in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decay):
            g = g.float()
            if scale != 1.0:
                g = g * scale
            if isinstance(d, torch.Tensor):
                p.mul_(1 - c.lr * c.weight_decay * d)
            elif d and c.weight_decay:
                p.mul_(1 - c.lr * c.weight_decay)
            m.lerp_(g, 1 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(c.eps)
            p.addcdiv_(m, denom, value=-c.lr / bc1)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.exp_avg + self.exp_avg_sq


def grad_norm(grads: list[torch.Tensor], counted: list[bool] | None = None, group=None) -> torch.Tensor:
    """Global L2 norm of the gradients, each parameter counted once.

    `counted[i]` is False for a tensor that another rank also holds and counts (a replica);
    `group` spans the ranks whose shards together make up the model (None: local only).
    """
    counted = counted or [True] * len(grads)
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g, c in zip(grads, counted):
        if c and g is not None:
            sq = sq + g.float().pow(2).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1.0 if disabled."""
    if not max_norm:
        return 1.0
    return min(1.0, max_norm / (float(norm) + 1e-6))
