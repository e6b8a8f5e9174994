"""Sharded data parallelism, mixed precision and activation checkpointing, predicted per rank.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., SC 2020, section 5 and
figure 1; memory.model_state_bytes gives the paper's formulas), here exactly as the lab lays
them out: every flat buffer is padded to a multiple of N (engines/parallel/flat.py), so with
P = Σ padded buffer sizes and S = P / N elements per rank, e bytes per compute element and
K = 8 (fp32: Adam's two moments) or 12 (bf16: fp32 master + moments),

    none (DDP)  e·Ψ + e·Ψ + K·Ψ        zero2       e·P + e·S + K·S
    zero1       e·P + e·P + K·S        zero3/fsdp  e·S + e·S + K·S

PyTorch's FSDP2 pads each parameter on dim 0 instead (rows split in chunks of ceil(d0/N)) and
keeps fp32 sharded parameters and gradients whatever the compute dtype (4 + 4 + 8 per element;
parameters and gradients in padded storage, Adam's moments only for the rows a rank holds).

Communication per step (section 7 of the paper, in elements of Ψ per rank, ring model;
gradients are reduced in fp32 and parameters gathered in the compute dtype, precision.py):
DDP all-reduces 2Ψ(N-1)/N; ZeRO-1/2 reduce-scatter the gradients and all-gather the updated
parameters, 2Ψ(N-1)/N; ZeRO-3 / FSDP gather every unit in forward and again in backward and
reduce-scatter its gradients, 3Ψ(N-1)/N (2Ψ with reshard_after_forward off). Ours add one
4-byte all-reduce for the global gradient norm, whose shards are disjoint.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.engines.parallel.flat import FlatPlan, bucket_plans, unit_of, unit_plans
from labkit.theory.memory import activation_bytes
from labkit.theory.model import num_params, param_shapes

DATA_DIMS = ("dp", "ep", "cp")
ELEM = {"fp32": 4, "bf16": 2}
"""Bytes per compute element (parameters, gradients, activations, gathered parameters)."""
REDUCE = 4
"""Bytes per element of a gradient reduction: fp32 in both precisions (engines/precision.py)."""


@lru_cache(maxsize=64)
def plans(cfg: ParallelConfig, model: ModelConfig, n: int) -> list[FlatPlan]:
    """The flat buffers of our ZeRO / FSDP for this layout (the engines build the same ones)."""
    shapes = param_shapes(model)
    if cfg.sharding in ("zero1", "zero2"):
        return bucket_plans(shapes, n, int(cfg.bucket_mb * 2**20), ELEM[cfg.precision])
    return unit_plans(shapes, n, "zero3" if cfg.sharding == "zero3" else "fsdp")


def fsdp2_rows(d0: int, n: int, index: int) -> tuple[int, int]:
    """FSDP2's Shard(0): (padded rows every rank stores, rows rank `index` really holds)."""
    chunk = -(-d0 // n)
    return chunk, max(0, min(chunk, d0 - index * chunk))


def state_bytes(cfg: ParallelConfig, model: ModelConfig, n: int, index: int = 0) -> dict[str, int]:
    """Bytes of params / grads / optimizer on data rank `index` of N = n after a step."""
    e, k = ELEM[cfg.precision], 8 + (4 if cfg.precision == "bf16" else 0)
    if cfg.sharding == "none":
        psi = num_params(model)
        return {"params": e * psi, "grads": e * psi, "optimizer": k * psi}
    if cfg.sharding == "fsdp" and cfg.impl == "torch":
        padded_local = held = 0
        for _, shape in param_shapes(model):
            chunk, rows = fsdp2_rows(shape[0], n, index)
            rest = prod(shape[1:])
            padded_local += chunk * rest
            held += rows * rest
        # parameters and gradients are views of padded flat storage; Adam's moments are not
        return {"params": 4 * padded_local, "grads": 4 * padded_local, "optimizer": 8 * held}
    ps = plans(cfg, model, n)
    P, S = sum(p.padded for p in ps), sum(p.shard for p in ps)
    return {"params": e * (P if cfg.sharding in ("zero1", "zero2") else S),
            "grads": e * (P if cfg.sharding == "zero1" else S),
            "optimizer": k * S}


def activation_peak(cfg: ParallelConfig, model: ModelConfig, micro: int) -> int:
    """Peak bytes saved for backward on one rank (microbatch of `micro` sequences).

    Without checkpointing: memory.activation_bytes. With it (engines/parallel/checkpoint.py)
    each block keeps only its input x (b, s, h) until backward, and backward recomputes one
    block at a time after the head's saved tensors are gone:
        embedding + L·|x| + max(head, block - |x|)
    (the recomputed block's own input is the |x| already counted)."""
    e = ELEM[cfg.precision]
    if not cfg.checkpoint_activations:
        return activation_bytes(model, micro, act_bytes=e)
    block = activation_bytes(model, micro, layers=1, head=False, embed=False, act_bytes=e)
    head = activation_bytes(model, micro, layers=0, head=True, embed=False, act_bytes=e)
    embed = activation_bytes(model, micro, layers=0, head=False, embed=True, act_bytes=e)
    x = e * micro * model.seq * model.hidden
    return embed + model.layers * x + max(head, block - x)


def unit_sizes(cfg: ParallelConfig, model: ModelConfig, n: int) -> dict[str, int]:
    """Elements of each unit's gathered (padded) buffer, in forward order."""
    if cfg.impl != "torch":
        return {p.unit: p.padded for p in plans(cfg, model, n)}
    sizes: dict[str, int] = {}
    for name, shape in param_shapes(model):   # FSDP2: each parameter padded on dim 0
        unit = unit_of(name, "fsdp")
        sizes[unit] = sizes.get(unit, 0) + fsdp2_rows(shape[0], n, 0)[0] * n * prod(shape[1:])
    return {u: sizes[u] for u in sorted(sizes, key=lambda u: (u != "", len(u), u))}


def unit_peaks(size: dict[str, int], reshard: bool) -> dict[str, int]:
    """Peak bytes of gathered parameters and of unsharded gradient buffers for units, replaying
    the order in which ZeRO3's hooks act (engines/parallel/zero.py):
      forward   a unit is gathered just before it runs and freed after it (reshard) or kept;
                the root ('') is gathered around the whole forward;
      backward  when the gradient of a unit's output arrives the unit is gathered (if it was
                freed) and its gradient buffer allocated; when its last gradient is in, its
                parameters are freed and its reduce-scatter launched, after waiting for the one
                still in flight, whose buffer is then freed (one reduce-scatter in flight).
                The root's hook fires first (on the loss) and its gradients complete last.
    `size`: elements of each unit, in forward order (root first); returns elements."""
    blocks = [u for u in size if u != ""]
    root = [""] if "" in size else []
    live = peak = 0
    for u in root + blocks:                      # forward
        live += size[u]
        peak = max(peak, live)
        if reshard and u != "":
            live -= size[u]
    if reshard:
        live -= sum(size[u] for u in root)
    grads = gpeak = 0
    in_flight = None
    for u in root + blocks[::-1]:                # backward
        if reshard:
            live += size[u]
            peak = max(peak, live)
        grads += size[u]
        gpeak = max(gpeak, grads)
        if u == "":
            continue
        live -= size[u]
        if in_flight is not None:
            grads -= size[in_flight]
        in_flight = u
    return {"gathered": peak, "reduce_buffers": gpeak}


def transient_peaks(cfg: ParallelConfig, model: ModelConfig, n: int) -> dict[str, int]:
    """Peak bytes of the transients the engines track beside activations: 'gathered' parameters
    (ZeRO-3 / FSDP) and 'reduce_buffers', the full gradient buffers that exist for a reduction
    (ZeRO-2's buckets, ZeRO-3 / FSDP's units, and under bf16 the fp32 copies that DDP and ZeRO-1
    reduce). FSDP2 (impl='torch') has only its gathered parameters tracked."""
    e = ELEM[cfg.precision]
    if cfg.sharding == "none":
        if cfg.precision == "fp32" or cfg.impl == "torch":
            return {}
        return {"reduce_buffers": REDUCE * num_params(model)}   # every bucket's copy until finish()
    if cfg.sharding in ("zero1", "zero2"):
        if cfg.sharding == "zero1" and cfg.precision == "fp32":
            return {}                                          # reduced in place
        # a buffer lives from its first gradient (zero2) or its launch (zero1) to the end of its
        # reduce-scatter, one in flight: two neighbours at most, as backward fills them in order
        sizes = [p.padded * REDUCE for p in plans(cfg, model, n)]
        return {"reduce_buffers": max([a + b for a, b in zip(sizes, sizes[1:])] or sizes)}
    reshard = cfg.sharding == "zero3" or cfg.reshard_after_forward
    peaks = unit_peaks(unit_sizes(cfg, model, n), reshard)
    if cfg.impl == "torch":
        return {"gathered": peaks["gathered"] * e}
    return {"gathered": peaks["gathered"] * e, "reduce_buffers": peaks["reduce_buffers"] * REDUCE}


def comm_rows(comm, cfg: ParallelConfig, model: ModelConfig, layout) -> None:
    """Every collective of one step of ZeRO / FSDP, per rank, in the order the engines issue them."""
    n = layout.size(*DATA_DIMS)
    label = layout.label(*DATA_DIMS)
    e, m = ELEM[cfg.precision], cfg.microbatches
    torch_fsdp = cfg.impl == "torch"
    for rank in comm.ranks(layout):
        if cfg.sharding in ("zero1", "zero2"):
            ps = plans(cfg, model, n)
            for _ in range(m if cfg.sharding == "zero2" else 1):
                for p in ps:
                    comm.add(rank, label, "reduce_scatter", p.padded * REDUCE, n)
            comm.add(rank, label, "all_reduce", 4, n)                  # the global norm
            for p in ps:
                comm.add(rank, label, "all_gather", p.padded * e, n)
            continue
        sizes = unit_sizes(cfg, model, n)
        reshard = cfg.sharding == "zero3" or cfg.reshard_after_forward
        order = list(sizes)
        back = [u for u in order if u == ""] + [u for u in order if u != ""][::-1]
        for _ in range(m):
            for u in order:
                comm.add(rank, label, "all_gather", sizes[u] * e, n)
            for u in back:
                if reshard:
                    comm.add(rank, label, "all_gather", sizes[u] * e, n)
            for u in [u for u in back if u != ""] + [u for u in back if u == ""]:   # the root's last
                comm.add(rank, label, "reduce_scatter", sizes[u] * REDUCE, n)
        if not torch_fsdp:
            comm.add(rank, label, "all_reduce", 4, n)                  # the global norm
        else:
            # clip_grad_norm_ over FSDP2's DTensor gradients: each parameter's norm is a Partial
            # DTensor; stacking them and taking the norm all-reduces one fp32 per parameter tensor
            comm.add(rank, label, "all_reduce", 4 * len(param_shapes(model)), n)
