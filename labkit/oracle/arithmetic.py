"""Which arithmetic a run's reference computes in: the run's own, rounding for rounding, or another.

A bf16 or fp8 layout held to the fp32 reference must be allowed its whole rounding error against it, a
bound so wide (the roundings on a gradient's chain, 10-30% on the test models) that a gradient 20% wrong
passes. Held to a reference that computes as it does, it is allowed only what differs. DERIVATIONS.md,
"The oracle's bounds", "Shared arithmetic", derives it; in short:

  shared   The layout splits only the batch (dp, ep, microbatches, pipeline stages; ZeRO and FSDP shard
           what is stored, not what is computed): each data rank runs one process's forward and backward
           on its rows, with the same kernels on the same values, and adds its microbatches' gradients and
           the ranks' in fp32. A one-process reference in the run's precision that splits its batch the
           same way (`Arithmetic.shards`, `microbatches`) computes every rounding the run computes, bit for
           bit (measured: every element of every step's reduced gradient of DDP, ZeRO-1/2/3, FSDP, HSDP,
           1F1B, checkpointing, bf16 and fp8 alike, and every final parameter), but the last: the run
           rounds its fp32 sum of the shards into its bf16 gradients. What a correct run may then differ by
           is one rounding and the fp32 sum's order, per element; a gradient 1% wrong is 2.5 such bounds.
           An expert's gradient under EP is one contraction over every shard's routed tokens, where the
           reference rounds each shard's part (two roundings more, bounded by the parts' sizes), and so is
           a tied embedding's under PP (the reference rounds the sum of its two uses, the stages add them
           in fp32: one more).
  other    Anything that splits a contraction or changes a kernel: TP and SP (partial sums), CP (attention
           in blocks), torch.compile (fused kernels), FSDP2 under fp8 (it casts its fp32 shard), a GPU (its
           kernels are not the notebook's). One rounding that differs changes the next op's inputs, and
           from there every rounding may flip: measured on TP, a reference sharing the batch split sits as
           far from the run as the fp32 one. These keep the fp32 (fp8: the fp8) reference and the counted
           chain's bound, and their logic is held exactly by the same layout run in fp32 (`twin`).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.config.choices import numerics
from labkit.theory.exact.model import param_shapes


@dataclass(frozen=True)
class Arithmetic:
    """What the reference of a run computes in, and why."""

    precision: str
    """The reference's precision: the run's where `shared`, else fp32 (fp8 runs: fp8, as torchao on one process)."""
    shards: int
    """Parts each step's batch is split into, each with its own forward and backward."""
    microbatches: int
    """Consecutive parts that one data rank accumulates (its microbatches): their losses are divided by it."""
    threads: int | None
    """The intra-op threads the reference computes with (the ranks'); None: the notebook's own."""
    shared: bool
    """Whether the reference computes every rounding the run does but its reduction's (module docstring)."""
    why: str
    """Why the arithmetic is or is not shared, in words."""


def arithmetic(result) -> Arithmetic:
    """The arithmetic of `result`'s reference (a RunResult)."""
    cfg = result.config
    kind = numerics(cfg.precision)
    data_ranks, m = cfg.dp * cfg.ep, cfg.microbatches
    if not kind.mixed:  # fp32: every layout within 1e-5 of the fp32 reference (DERIVATIONS.md), as before
        return Arithmetic("fp32", 1, 1, None, False, "fp32: the layout reorders fp32 sums")
    threads = {rk.threads for rk in result.ranks}
    why = _not_shared(cfg, {rk.device for rk in result.ranks}, threads)
    if why:
        # the fp8 reference keeps its batch split: an activation's scale is the amax of the rows a forward sees
        if kind.fp8:
            return Arithmetic(cfg.precision, data_ranks * m, m, None, False, why)
        return Arithmetic("fp32", 1, 1, None, False, why)
    return Arithmetic(
        cfg.precision,
        data_ranks * m,
        m,
        threads.pop(),
        True,
        f"shared: {data_ranks} data rank(s) x {m} microbatch(es), each one process's {cfg.precision} arithmetic",
    )


def _not_shared(cfg, devices: set, threads: set) -> str:
    """Why a mixed-precision layout's arithmetic is not one process's (empty: it is)."""
    if cfg.tp > 1:
        return "tp splits the matmuls' contractions: each rank rounds its partial sums"
    if cfg.cp > 1:
        return "cp computes attention in blocks, and each weight's gradient in parts of the sequence"
    if cfg.compile:
        return "torch.compile fuses the blocks' kernels"
    if cfg.torch_impl and (cfg.numerics.fp8 or not cfg.sharded.params):
        return "PyTorch's strategy computes its own way (FSDP2 casts its fp32 shard to fp8)"
    if cfg.torch_impl:  # FSDP2 in bf16: one process's forward and backward, PyTorch's AdamW and clip after
        return "PyTorch's AdamW and clip_grad_norm_ update the masters in their own arithmetic (`first_shared`)"
    if devices != {"cpu"}:
        return f"the ranks compute on {sorted(devices)}, the reference on this process's CPU"
    if len(threads) != 1 or 0 in threads:
        return f"the ranks' intra-op threads ({sorted(threads)}) are not one known count"
    return ""


def first_shared(result) -> Arithmetic | None:
    """The arithmetic of `result`'s first step where only that step's is one process's (None elsewhere):
    FSDP2 in bf16 computes each data rank's forward and backward as one process does, but PyTorch's AdamW
    and clip_grad_norm_ round the masters' update otherwise than labkit's (a clip coefficient computed in
    fp32 tensors; measured: masters 1e-8 apart after three steps, bf16 weights flipping where they straddle
    a rounding), so the steps after the first are the counted bound's. The first step's masters are the
    init, the same on both sides."""
    cfg = result.config
    if not (cfg.torch_impl and cfg.numerics.mixed and not cfg.numerics.fp8 and cfg.sharded.params):
        return None
    base = cfg.replace(impl="lab")
    threads = {rk.threads for rk in result.ranks}
    if _not_shared(base, {rk.device for rk in result.ranks}, threads):
        return None
    m = cfg.microbatches
    return Arithmetic(cfg.precision, cfg.dp * cfg.ep * m, m, threads.pop(), True, "shared at the first step")


def expert_tensors(model) -> frozenset[str]:
    """The routed experts' stacked parameters (E, ...): under EP each expert's gradient is one contraction
    over every shard's tokens routed to it (engines/parallel/experts.py)."""
    if not model.experts:
        return frozenset()
    return frozenset(n for n, shape in param_shapes(model) if ".mlp.w" in n and shape[0] == model.experts)


def extra_roundings(result) -> dict[str, int]:
    """Per parameter, the roundings a shared-arithmetic run makes or skips beyond its reduction's, each
    bounded by u times the sum of the shards' |gradients| (module docstring): 2 for an expert's under EP,
    1 for a tied embedding's under PP, and M - 1 for every tensor where ZeRO-2/3 or FSDP add each of M
    microbatches' reduced gradients into their bf16 slice (engines/parallel/zero.py, zero3.py: without a
    pipeline they keep no full gradient to sum them in fp32)."""
    cfg, model = result.config, result.model
    out: dict[str, int] = {}
    if cfg.microbatches > 1 and cfg.pp == 1 and cfg.sharded.grads and not cfg.torch_impl:
        out = {n: cfg.microbatches - 1 for n, _ in param_shapes(model)}
    if cfg.ep > 1:
        out.update({n: out.get(n, 0) + 2 for n in expert_tensors(model)})
    if cfg.pp > 1 and model.tied:
        out["embed.tok.weight"] = out.get("embed.tok.weight", 0) + 1
    return out


def twin(cfg, device: str = "cpu"):
    """The same layout in fp32, whose logic the oracle holds at 1e-5, for a mixed-precision layout on
    `device` whose arithmetic no reference shares (None where one does, or for fp32: nothing to add)."""
    if not numerics(cfg.precision).mixed or not _not_shared(cfg, {device}, {1}):
        return None
    return cfg.replace(precision="fp32", fp8_recipe="tensorwise")
