"""The oracle: one process, no parallelism, the whole global batch at once.

Every layout must reproduce its losses and final parameters (fp32 within 1e-5 relative, bf16
within 2e-2). It shares only the model, the data and the optimizer formula with the engines,
never a strategy, so a bug in a strategy cannot hide in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.config import ModelConfig, OptimConfig


@dataclass
class Reference:
    losses: list[float]
    """Mean loss over the global batch, per step (before that step's update)."""
    grad_norms: list[float]
    """Global gradient norm per step, before clipping."""
    params: dict[str, np.ndarray] = field(repr=False)
    """Final parameters, full tensors, by name (fp32)."""


def reference(model: ModelConfig | None = None, steps: int = 3, seed: int = 0, global_batch: int = 8,
              precision: str = "fp32", optim: OptimConfig | None = None) -> Reference:
    """Train `steps` steps of `model` on one process and return losses and final parameters."""
    import torch

    from labkit.engines import data
    from labkit.engines.model import build_model
    from labkit.engines.optim import AdamW, clip_coefficient, decays, grad_norm
    from labkit.engines.precision import compute_copy

    model = model or ModelConfig()
    optim = optim or OptimConfig()
    torch.manual_seed(seed)   # nothing random is drawn from it; set for any future dropout
    net = build_model(model, seed)
    names, params = zip(*net.named_parameters())
    opt = AdamW(list(params), optim, [decays(n, p) for n, p in zip(names, params)])
    compute = compute_copy(net, precision)   # the module that runs forward/backward
    losses, norms = [], []
    for step in range(steps):
        tokens, targets = data.global_batch(step, seed, global_batch, model.seq, model.vocab)
        loss = compute.module(tokens, targets)
        loss.backward()
        loss = loss.detach()
        grads = compute.master_grads()
        norm = grad_norm(grads)
        opt.step(grads, clip_coefficient(norm, optim.clip))
        compute.after_step()
        losses.append(loss.item())
        norms.append(float(norm))
    return Reference(losses, norms, {n: p.detach().float().numpy().copy() for n, p in net.named_parameters()})
