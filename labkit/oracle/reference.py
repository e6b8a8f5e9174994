"""The oracle: one process, no parallelism, the whole global batch at once.

Every layout must reproduce its losses, gradient norms, gradients and final parameters
(labkit/oracle/checks.py), held to this reference replayed along the run in the run's own arithmetic
where one process computes it (labkit/oracle/arithmetic.py: a bf16 or fp8 layout that splits only the
batch), else in fp32, with the bounds of labkit/oracle/bounds.py. It shares only the model, the data
and the optimizer formula with the engines, never a strategy, so a bug in a strategy cannot hide in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.config import ConfigError, ModelConfig, OptimConfig
from labkit.config.choices import Data, Precision, numerics, trains_on_text
from labkit.config.float8 import Fp8Recipe, float8_scaling
from labkit.config.validation import data_problems

FP32_SUMS = 1e-5
"""How far two fp32 norms of the same gradients, summed in two orders, may differ (relative): fp32's bound
(DERIVATIONS.md, "The oracle's bounds")."""


@dataclass
class Reference:
    losses: list[float]
    """Mean loss over the global batch, per step (before that step's update)."""
    grad_norms: list[float]
    """Global gradient norm per step, before clipping."""
    params: dict[str, np.ndarray] = field(repr=False)
    """Final parameters, full tensors, by name (fp32)."""
    first_grads: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """The first step's gradient of every parameter, by name (fp32): the mean over the global
    batch (over the shards' fp32 sum), before clipping and the update — what a layout's reduced
    gradient must equal (labkit/oracle/checks.py, gradient parity)."""
    precision: Precision = "fp32"
    """The precision it computed in (checks.py holds every layout to the fp32 one)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model trained (what generate builds)."""
    data: Data = "synthetic"
    """What it trained on: 'synthetic' or 'text'."""
    validation_loss: float | None = None
    """data='text': the mean loss of the final model on the held-out validation windows (the same
    windows, in the same global batches, as a run's RunResult.validation_loss); else None."""
    buffers: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    """Final buffers that training changes, by name (fp32): the MoE routers' aux-loss-free biases
    (engines/moe.py `update_expert_bias`), updated from the whole batch's expert loads."""
    step_grads: list[dict[str, np.ndarray]] = field(default_factory=list, repr=False)
    """A replayed reference's gradient at every step (labkit/oracle/replay.py: computed at the parameters
    the run's own gradients led to); a plain reference keeps the first alone (first_grads)."""
    replayed: object = field(default=None, repr=False)
    """A replay's record (labkit/oracle/replay.py `Replayed`: the routing flips it followed and those
    it refused); None for a plain reference."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """precision='fp8': how its linear layers scaled (torchao's recipe)."""
    shards: int = 1
    """Parts each step's batch was split into, each with its own forward and backward."""
    seed: int | None = None
    """The seed it trained with (the weights and the batches); None where unknown."""
    global_batch: int | None = None
    """Sequences per step; None where unknown."""
    optim: OptimConfig | None = None
    """The optimizer it stepped with; None where unknown."""
    microbatches: int = 1
    """Consecutive shards that one data rank accumulates: each shard's loss divided by it before its
    backward, the shards' sum by the data ranks (shards / microbatches), as a layout's ranks do."""
    step_spread: list[dict[str, float]] = field(default_factory=list, repr=False)
    """A shared-arithmetic replay's, per step and parameter: ||Σ_s |g_s| / data ranks||, the size of what
    the reduction sums (labkit/oracle/bounds.py `shared_bounds`); empty otherwise."""

    def generate(self, prompt: str, tokens: int, temperature: float = 0.8, seed: int = 0) -> str:
        """`tokens` bytes that continue `prompt`, sampled from the final parameters, as
        RunResult.generate does (engines/generate.py)."""
        from labkit.engines.generate import generate  # torch: loaded when sampling, not with the reference

        return generate(self.model, self.params, prompt, tokens, temperature, seed)


def reference(
    model: ModelConfig | None = None,
    steps: int = 3,
    seed: int = 0,
    global_batch: int = 8,
    precision: Precision = "fp32",
    optim: OptimConfig | None = None,
    shards: int = 1,
    threads: int | None = None,
    data: Data = "synthetic",
    fp8_recipe: Fp8Recipe = "tensorwise",
) -> Reference:
    """Train `steps` steps of `model` on one process and return losses and final parameters.

    data='text' trains on the corpus (labkit/layout/text.py, the same batches as Lab.run(...,
    data='text')) and computes the validation loss after the last step; steps=0 gives the
    untrained model (its validation loss, its samples).

    precision='bf16' computes forward and backward on a bf16 copy of the fp32 master weights
    (engines/precision.py: the ZeRO paper's mixed precision). shards > 1 splits each step's batch
    into that many equal parts, each with its own backward, and sums their gradients in fp32
    (then divides by `shards`): the arithmetic of a layout with that many data shards. In fp32 it
    changes nothing that matters (~1e-7). In bf16 it does: each shard's gradient is rounded to
    bf16 before the sum, and AdamW turns any gradient element whose sign that rounding flips
    into a full step of lr the other way (checks.py). One process splitting its batch in two
    already moves a LayerNorm bias of the tiny test model by 25% (relative L2) against the
    unsplit run, with no parallel code involved: why the oracle replays a bf16 layout's reference
    split as the layout splits its batch (labkit/oracle/arithmetic.py), and replays it along the run.

    threads: intra-op threads for this run (default: leave torch's setting). bf16 results depend
    on how a kernel splits its work: the same bf16 run on 1 and on 2 threads differs by ~1e-2 in
    that LayerNorm bias. Give the engines' count to compute exactly their arithmetic.

    precision='fp8' computes on that bf16 copy with its blocks' linear layers converted to torchao's
    Float8Linear (`fp8_recipe`, torchtitan's filter: engines/float8.py) — the oracle of fp8 layouts,
    with `shards` as the layout splits its batch, since an activation's scale is the amax of the rows
    a forward sees (labkit/oracle/bounds_fp8.py says why and what it bounds).
    """
    found = data_problems(data, model or ModelConfig())
    if numerics(precision).fp8 and float8_scaling(fp8_recipe).not_built:
        found.append(float8_scaling(fp8_recipe).not_built)
    if found:
        raise ConfigError(found)
    # torch when the reference trains, not when the oracle is imported (the kernel never loads it else)
    import torch

    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return reference(
                model, steps, seed, global_batch, precision, optim, shards, data=data, fp8_recipe=fp8_recipe
            )
        # the notebook's own thread count comes back, whatever the reference did
        finally:
            torch.set_num_threads(before)

    model, optim = model or ModelConfig(), optim or OptimConfig()
    return train(model, steps, seed, global_batch, precision, optim, shards, data, fp8_recipe=fp8_recipe)


def train(
    model,
    steps,
    seed,
    global_batch,
    precision,
    optim,
    shards,
    data,
    follow=None,
    fp8_recipe: Fp8Recipe = "tensorwise",
    *,
    microbatches: int = 1,
    spread: bool = False,
) -> Reference:
    """reference()'s loop. `follow` (labkit/oracle/replay.py `Follow`): each step's gradients are
    still computed here, but the update applies the run's (follow.grads), clipped by the run's own norm
    (follow.norm), and MoE layers route as the run routed where the two tie (follow.install).
    `microbatches`: the consecutive shards of one data rank (Reference.microbatches); `spread`: keep the
    size of each step's shard sum per parameter (Reference.step_spread)."""
    import torch

    from labkit.engines import data as batches
    from labkit.engines.evaluate import reference_validation_loss
    from labkit.engines.model import build_model
    from labkit.engines.moe import update_expert_bias
    from labkit.engines.muon import Optimizer
    from labkit.engines.optim import clip_coefficient, decays, grad_norm
    from labkit.engines.precision import compute_copy

    torch.manual_seed(seed)  # nothing random is drawn from it; set for any future dropout
    net = build_model(model, seed)
    # registration order; weight decay on matrices only, decided as the engines decide it (nanoGPT's rule)
    names, params = zip(*net.named_parameters())
    # AdamW, or Muon for the matrices the rule routes to it (engines/muon.py: torch.optim.Muon's update)
    full = [(n, tuple(p.shape)) for n, p in zip(names, params)]
    opt = Optimizer(list(params), [decays(n, p) for n, p in zip(names, params)], optim, full)
    compute = compute_copy(net, precision, fp8_recipe)  # the module that runs forward/backward
    losses, norms, every, spreads = [], [], [], []
    for step in range(steps):
        if follow is not None:
            follow.install(compute.module, step)
        tokens, targets = batches.batch(data, step, seed, global_batch, model)
        loss, grads, size = 0.0, None, None
        for i in range(shards):
            if follow is not None:
                follow.shard(i, shards, global_batch)
            # each shard's mean loss; their sum is divided by `shards` below, as data ranks' means are averaged
            part = compute.module(batches.shard(tokens, i, shards), batches.shard(targets, i, shards))
            # a microbatch's loss divided before its backward, as engines/accumulate.py divides it
            (part / microbatches if microbatches > 1 else part).backward()
            loss = loss + part.detach()
            # each shard's gradient as fp32 master gradients, summed here in fp32, as a layout's reduction sums;
            # zeroed after, so autograd never accumulates shards in the compute dtype
            mine = compute.master_grads()
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
            if spread:
                size = [g.abs() for g in mine] if size is None else [a + g.abs() for a, g in zip(size, mine)]
            compute.zero_grads()
        if shards > 1:
            loss, grads = loss / shards, [g / (shards // microbatches) for g in grads]
        if spread:
            spreads.append({n: float((s / (shards // microbatches)).norm()) for n, s in zip(names, size)})
        norm = grad_norm(grads)
        if step == 0 or follow is not None:  # a plain reference keeps the first alone: a long run's would not fit
            every.append({n: g.detach().float().numpy().copy() for n, g in zip(names, grads)})
        # the run's own gradients where the reference replays it: what a difference in them does
        # through AdamW is the optimizer's, not the layout's (DERIVATIONS.md, "The oracle's bounds")
        applied = grads if follow is None else follow.grads(step, names, grads)
        # clipped by the global norm, before the update, as every layout does; a replay by the norm of the run's
        # gradients, and by the one the run reported where the two agree to fp32's rounding of their sums, so
        # that the same gradients make the same update bit for bit (a wrong reported norm: checks.grad_norms)
        clip_by = norm
        if follow is not None:
            clip_by, ran = grad_norm(applied), follow.norm(step)
            if ran is not None and abs(ran - float(clip_by)) <= FP32_SUMS * float(clip_by):
                clip_by = ran
        opt.step(applied, clip_coefficient(clip_by, optim.clip))
        update_expert_bias(compute.module.modules())  # the whole global batch's loads, on one process
        # the compute copy taken again from the updated masters (bf16: rounded)
        compute.after_step()
        losses.append(loss.item())
        norms.append(float(norm))
    validation = reference_validation_loss(compute.module, model, global_batch) if trains_on_text(data) else None
    final = {n: p.detach().float().numpy().copy() for n, p in net.named_parameters()}
    buffers = {n: b.detach().float().numpy().copy() for n, b in compute.module.named_buffers()}
    first = every[0] if every else {}
    record = follow.record if follow is not None else None
    return Reference(
        losses,
        norms,
        final,
        first,
        precision,
        model,
        data,
        validation,
        buffers,
        every,
        record,
        fp8_recipe,
        shards,
        seed,
        global_batch,
        optim,
        microbatches,
        spreads,
    )
