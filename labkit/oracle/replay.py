"""The reference replayed along a run: at every step one process computes its own loss, gradient
norm and gradients, then updates with the *run's* reduced gradients, and routes as the run routed
where the two arithmetics tie. Every step is then compared as the first is: one step's arithmetic,
held by one step's bounds (labkit/oracle/bounds.py), every tensor at every step.

Why (DERIVATIONS.md, "The oracle's bounds", "What the optimizer does with a rounding"): AdamW's first
update of an element is lr·g/(|g| + ε), whose slope ε/(|g| + ε)² is 1/ε at g = 0. Two correct
computations of one step differ in each gradient element by the rounding of reordered sums, δ;
an element whose |g| is within a few ε of zero (a weight whose contributions cancel: 5.5e-9 with
ε = 1e-8 in the issue's GPT-2) turns δ = 4e-10 into an update 5e-5 apart, a thousand times the
step's own rounding, and the next step's loss and gradients move with it. No bound on a step's
arithmetic holds what the optimizer makes of it, and a bound wide enough to would hold no bug.
Replaying the run's gradients removes the optimizer's amplification from the comparison and
nothing else: the replay takes from the run only its reduced gradients (and its routing, below);
its forward, backward, reduction, norm, clipping and optimizer arithmetic are the reference's own,
so a bug in any of them shows at the step it happens (gradients, losses and norms at every step,
the final parameters against the same AdamW applied to the same gradients).

Routing: a top-k is a step function of the router's logits. Where a token's k best experts are
within the arithmetic's error of a tie, a bf16 run may pick others than the fp32 reference (2 to
3 tokens of 512 per layer on the tiny MoE model), and the gradients of the experts involved move
by a whole token's share. The reference takes the run's choice for such a token when it is one
the arithmetic allows: the run's experts, each raised by the error bound E of its logit and every
other lowered by its own, are the top k (`legitimate`); E = (path·u_run + (path + h)·u_fp32)·
(|W|·|x| + |b|), path = 2l + 4 rounded tensors on the way to layer l's logits (the bound bounds.py
uses for gradients, DERIVATIONS.md). A choice beyond that is a bug (a bias from one rank's loads, a
router from another layer's weights) and is reported, and the reference keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from labkit.config.choices import numerics
from labkit.oracle.arithmetic import Arithmetic
from labkit.oracle.bounds import UNIT_ROUNDOFF
from labkit.oracle.reference import Reference, train


@dataclass
class Replayed:
    """What a replay followed and refused."""

    flips: list[dict[int, int]] = field(default_factory=list)
    """Per step, per MoE layer: tokens whose experts the reference took from the run (legitimate ties)."""
    refused: list[dict] = field(default_factory=list)
    """Tokens whose run choice is beyond the arithmetic's error: {step, layer, row, position, run,
    own, excess} (excess > 1: by how many error bounds the swap's logits are apart)."""


class Follow:
    """What `reference.train` asks of the run it replays (its `follow`)."""

    def __init__(self, result):
        self.result = result
        self.record = Replayed()
        self.u_run = UNIT_ROUNDOFF["bf16" if numerics(result.config.precision).mixed else "fp32"]
        self.rows = slice(None)  # the global batch's rows the current forward computes (`shard`)

    def shard(self, index: int, count: int, size: int) -> None:
        """The next forward computes shard `index` of `count` of the step's `size` sequences (the rows
        data.shard cuts): the run's routing of those rows is what it follows."""
        rows = size // count
        self.rows = slice(index * rows, (index + 1) * rows)

    def install(self, module, step: int) -> None:
        """Route every MoE layer of `module` as the run routed at `step`, where the two tie."""
        from labkit.engines.moe import MoE  # torch: the replay trains, the oracle's import does not

        self.record.flips.append({})
        routes = self.result.routes or {}
        for m in module.modules():
            if isinstance(m, MoE):
                m.follow = None if m.layer not in routes else _Route(self, step, routes[m.layer][step])

    def norm(self, step: int) -> float | None:
        """The global gradient norm the run clipped `step` with (every rank computes it after its
        reduction: rank 0's), so that the replay's update of the run's gradients is the run's; None where it
        reported none (the replay then clips by the norm of the run's gradients)."""
        norms = self.result.ranks[0].grad_norms if self.result.ranks else []
        return norms[step] if step < len(norms) else None

    def grads(self, step: int, names, own) -> list:
        """The run's reduced gradients of `step`, as the tensors the optimizer takes (in `names`' order)."""
        import torch

        run = self.result.step_grads[step]
        # the reference's tensors the run has not, or not in its shape: a reference of another model
        wrong = [n for n, g in zip(names, own) if n not in run or tuple(run[n].shape) != tuple(g.shape)]
        if wrong:
            raise AssertionError(
                f"step {step}: the run has no gradient of the reference's shape for {wrong[:3]}: "
                "is the reference of the run's model?"
            )
        return [torch.from_numpy(np.ascontiguousarray(run[n])).to(g.dtype).reshape(g.shape) for n, g in zip(names, own)]


class _Route:
    """One MoE layer's `follow` at one step: the run's experts (B, S, k) for the whole global batch."""

    def __init__(self, follow: Follow, step: int, experts: np.ndarray):
        self.follow, self.step, self.experts = follow, step, experts

    def __call__(self, moe, x, logits, own):
        import torch

        run = torch.from_numpy(self.experts[self.follow.rows].astype(np.int64)).to(own.device)  # (b, s, k)
        differ = (run.sort(-1)[0] != own.sort(-1)[0]).any(-1)  # (B, S)
        if not differ.any():
            return own
        bound = error_bound(moe, x, self.follow.u_run)  # (B, S, E)
        ok, excess = legitimate(moe, logits.detach(), bound, run)
        take = differ & ok & (run >= 0).all(-1)
        flips = self.follow.record.flips[-1]
        flips[moe.layer] = flips.get(moe.layer, 0) + int(take.sum())  # summed over the step's shards
        for row, pos in (differ & ~take).nonzero().tolist():
            self.follow.record.refused.append(
                {
                    "step": self.step,
                    "layer": moe.layer,
                    "row": row + (self.follow.rows.start or 0),
                    "position": pos,
                    "run": run[row, pos].tolist(),
                    "own": own[row, pos].tolist(),
                    "excess": float(excess[row, pos]),
                }
            )
        return torch.where(take.unsqueeze(-1), run, own)


def error_bound(moe, x, u_run: float):
    """E (b, s, E): how far the run's logits of layer `moe.layer` may sit from the reference's, each side's
    rounding on the path to them times the size of what the router sums (Higham, section 3.1: a dot
    product's error is relative to Σ|w_i x_i|, not to its value)."""
    path = 2 * moe.layer + 4
    router = moe.router
    size = x.detach().abs().float() @ router.weight.detach().abs().float().t()  # (b, s, h) @ (h, E)
    if router.bias is not None:
        size = size + router.bias.detach().abs().float()
    u32 = UNIT_ROUNDOFF["fp32"]
    return (path * u_run + (path + x.shape[-1]) * u32) * size


def legitimate(moe, logits, bound, run):
    """Per token (b, s): whether the run's experts are the top k once each is raised by its error
    bound and every other expert lowered by its own — the most the arithmetic can favour them — and
    by how many bounds the worst swapped pair is apart (<= 1 where legitimate)."""
    import torch

    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, run.clamp(min=0), True)  # (b, s, E)
    favoured = logits + torch.where(chosen, bound, -bound)
    ok = (moe.choose(favoured).sort(-1)[0] == run.sort(-1)[0]).all(-1)
    # the worst pair: an expert the run left out that still beats one it took, in units of their bounds
    gap = logits.unsqueeze(-1) - logits.unsqueeze(-2)  # (b, s, E out, E in): z_out - z_in
    room = bound.unsqueeze(-1) + bound.unsqueeze(-2)
    pair = (~chosen).unsqueeze(-1) & chosen.unsqueeze(-2)
    excess = torch.where(pair, gap / room.clamp(min=1e-30), torch.full_like(gap, -np.inf)).amax(dim=(-1, -2))
    return ok, excess


def replay(result, ref, arith: Arithmetic) -> Reference:
    """`ref`, the reference the run is held to, trained again along the run (the module docstring): its
    own model, seed, global batch, optimizer and data, in the arithmetic `arith` (labkit/oracle/arithmetic.py:
    the run's precision, batch split and threads where the run's arithmetic is one process's), each step's
    update applying the run's gradients of that step instead of its own. Needs the run's gradients of
    every step (return_params=True). A reference of another run (another seed, batch, optimizer) stays
    another run's: its own gradients and updates show the difference from the first step on."""
    import torch

    if not result.step_grads:
        raise ValueError("replay needs the run's gradients of every step: run it with return_params=True")
    known = lambda mine, run: run if mine is None else mine  # noqa: E731 - a field an older Reference lacks
    before = torch.get_num_threads()
    if arith.threads is not None:  # a bf16 kernel's result depends on how many threads split its work
        torch.set_num_threads(arith.threads)
    try:
        return train(
            ref.model,
            result.steps,
            known(ref.seed, result.seed),
            known(ref.global_batch, result.config.global_batch),
            arith.precision,
            known(ref.optim, result.optim),
            arith.shards,
            ref.data,
            follow=Follow(result),
            fp8_recipe=result.config.fp8_recipe,
            microbatches=arith.microbatches,
            spread=arith.shared,
        )
    finally:  # the notebook's own thread count comes back, whatever the replay did
        torch.set_num_threads(before)
