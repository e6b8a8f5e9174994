"""Lab.verify on one rank: the user's build and parallelize, then a few plain steps, with every
parameter (right after parallelize, at the end) and the first step's gradient read out by name.

The notebook side (labkit/oracle/verify.py) runs the same steps on `build()` alone and judges
what comes back. Here nothing is judged: each rank sends, per tensor, its whole value (a DTensor
assembled with `full_tensor()` over its own mesh, which reduces a Partial gradient and gathers
Shard and FSDP2 pieces alike), named by the fully-qualified name `build()` gave it. Copies of one
tensor on several ranks (DDP replicas, `Replicate` placements, tied weights on two pipeline
stages) are then compared bit for bit by labkit/oracle/assembly.py.

Names: wrappers add path segments (DDP's `module.`, torch.compile's `_orig_mod.`, activation
checkpointing's `_checkpoint_wrapped_module.`); they are dropped. A tied weight has two names in
`build()` (GPT-2's `lm_head.weight` is `transformer.wte.weight`); both map to the name
`named_parameters()` lists first, so a pipeline stage that holds only the head sends its copy
under the embedding's name.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

from labkit.engines import runtime
from labkit.engines.meters.rounding import depths

WRAPPERS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Path segments that wrappers insert between a model and its parameters (DDP, torch.compile,
checkpoint_wrapper, FSDP1): not part of the name `build()` gave the parameter."""


@dataclass
class RankContext:
    """What a user's rank step gets besides the model and the global batch."""

    mesh: object
    """The DeviceMesh that `parallelize` got."""
    rank: int
    dp_rank: int
    """This rank's data-parallel coordinate: the index of its slice of the global batch."""
    dp_size: int
    """How many slices the global batch is cut into (the product of the data dims' sizes)."""
    loss: object
    """The user's loss(model, batch) -> scalar."""
    device: object = None
    """This rank's torch.device (a GPU each under NCCL): where `shard` puts the slice."""

    def shard(self, batch):
        """This rank's slice of `batch` along dim 0, on this rank's device (what the default step trains on)."""
        return to_device(slice_batch(batch, self.dp_rank, self.dp_size), self.device)


def slice_batch(batch, index: int, parts: int):
    """The index-th of `parts` equal slices along dim 0 of every tensor in batch (a tensor, a
    tuple / list or a dict of them; anything else is passed whole)."""
    import torch

    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise ValueError(f"the global batch has {batch.shape[0]} rows: they do not split into {parts} equal slices")
        n = batch.shape[0] // parts
        return batch[index * n : (index + 1) * n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(slice_batch(b, index, parts) for b in batch)
    if isinstance(batch, dict):
        return {k: slice_batch(v, index, parts) for k, v in batch.items()}
    return batch


def to_device(batch, device):
    """batch's tensors on `device` (None: where they are); the global batch is made on the CPU."""
    if device is None:
        return batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch.to(device) if hasattr(batch, "to") else batch


def plain_step(model, batch, ctx: RankContext):
    """The default rank step: the loss of this rank's slice of the global batch, and its backward."""
    loss = ctx.loss(model, ctx.shard(batch))
    loss.backward()
    return loss


def default_optimizer(params):
    """AdamW at lr 1e-3 (torch's defaults otherwise): what most training scripts start from."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3)


def canonical_names(model) -> dict[str, str]:
    """Every name of every parameter of the model `build()` returned -> the first name of that
    parameter (tied weights share one)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def strip_wrappers(name: str) -> str:
    return ".".join(s for s in name.split(".") if s not in WRAPPERS)


def fingerprints(model) -> dict[str, str]:
    """A hash of each parameter's bytes: whether two builds gave the same weights, without sending them."""
    return {n: hashlib.sha1(p.detach().cpu().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}


def read_tensors(model, names: dict[str, str], rank: int, grads: bool = False) -> tuple[list[dict], list[str]]:
    """(pieces, unknown names): each parameter (or its gradient) as the whole tensor this rank
    holds, under its canonical name; names that `build()` never gave come back apart."""
    import torch
    from torch.distributed.tensor import DTensor

    out, unknown, sent = [], [], set()
    # every rank of a DTensor's mesh walks the same module in the same order, so the full_tensor
    # collectives below line up; pipeline stages hold different tensors on disjoint meshes
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = names.get(strip_wrappers(name))
        if canon is None:
            unknown.append(name)
            continue
        if canon in sent:  # a tied weight: one copy per rank
            continue
        sent.add(canon)
        t = p.grad if grads else p
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()
        values = t.detach().cpu().to(dtype=torch.float32, copy=True).numpy()
        out.append(
            {
                "name": canon,
                "shape": list(values.shape),
                "box": None,
                "flat": None,
                "values": values,
                "rank": rank,
                "dtype": str(t.dtype).removeprefix("torch."),
            }
        )
    return out, unknown


def as_loss(value, step: int):
    """The rank step's return as a float (None where this rank computes no loss)."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"step {step}: the loss has shape {tuple(value.shape)}; it must be a scalar (use .mean())")
        if hasattr(value, "full_tensor"):  # a DTensor loss (loss_parallel): its value is the same on every rank
            value = value.full_tensor()
        return float(value.detach().float().item())
    return float(value)


def counted_step(model, step, batch, ctx, names: dict[str, str]):
    """The user's step, run once under the rounding count (engines/meters/rounding.py): (what it returned,
    {canonical name: the roundings on the longest chain to its gradient}). A mixed-precision run's bound is
    what its own parallelized graph rounds, not build()'s."""
    ran = []
    counted = depths(model, lambda m: ran.append(step(m, batch, ctx)))
    return ran[0], {names[strip_wrappers(n)]: d for n, d in counted.items() if strip_wrappers(n) in names}


def verify_rank(blob: bytes, spec: dict) -> dict:
    """Lab.verify's body on every rank: build, parallelize on a DeviceMesh of spec['mesh'], then
    spec['steps'] steps (the rank step's forward and backward, then optimizer.step()); returns
    plain data: the weights after parallelize, every step's gradients, the final weights,
    each step's loss, the plan's warnings."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    fns = cloudpickle.loads(blob)
    rt = runtime.current()
    torch.manual_seed(spec["seed"])  # the same seed as the reference's build(), on every rank
    model = fns["build"]()
    names = canonical_names(model)
    # build() must give every rank the weights it gave the notebook: a rank whose differ stops all
    # ranks together, before the first collective of the mesh (else the others would wait on it)
    mine = fingerprints(model)
    differ = sorted(n for n, h in spec["fingerprints"].items() if mine.get(n) != h)
    # on the rank's device: NCCL's collectives take CUDA tensors only
    flag = torch.tensor([1 if differ or set(mine) != set(spec["fingerprints"]) else 0], device=rt.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        return {"rank": rt.rank, "build_differs": differ or sorted(set(mine) ^ set(spec["fingerprints"]))}

    sizes = spec["mesh"]
    kind = torch.device(rt.device).type
    mesh = init_device_mesh(kind, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    coords = dict(zip(sizes, mesh.get_coordinate()))
    dp_rank, dp_size = 0, 1
    for dim in spec["data_dims"]:  # row-major over the data dims, in the mesh's order
        dp_rank, dp_size = dp_rank * sizes[dim] + coords[dim], dp_size * sizes[dim]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        returned = fns["parallelize"](model, mesh)
    model = model if returned is None else returned  # parallelize may work in place
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"parallelize returned {type(model).__name__}: return the parallelized nn.Module (or None)")
    ctx = RankContext(mesh, rt.rank, dp_rank, dp_size, fns["loss"], torch.device(rt.device))
    initial, unknown = read_tensors(model, names, rt.rank)
    opt = fns["optimizer"]([p for p in model.parameters()])
    step = fns["step"] or plain_step
    losses, grads, roundings = [], [], {}
    for s in range(spec["steps"]):
        runtime.check_cancelled()
        if s == 0 and spec.get("count_roundings"):
            out, roundings = counted_step(model, step, fns["batch"](s), ctx, names)
            loss = as_loss(out, s)
        else:
            loss = as_loss(step(model, fns["batch"](s), ctx), s)
        # every step's: the reference replays them (labkit/oracle/replay.py says why)
        grads.append(read_tensors(model, names, rt.rank, grads=True)[0])
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        runtime.progress(step=s, rank=rt.rank, loss=loss)
    final, _ = read_tensors(model, names, rt.rank)
    return {
        "rank": rt.rank,
        "coords": coords,
        "dp_rank": dp_rank,
        "warnings": [str(w.message) for w in caught],
        "unknown": unknown,
        "initial": initial,
        "grads": grads,
        "final": final,
        "losses": losses,
        "roundings": roundings,
    }
