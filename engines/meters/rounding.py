"""How many roundings a gradient passes through: counted on the computation itself, op by op.

bf16's bound on a gradient element is one unit roundoff u per rounding on the longest chain of
rounded tensors that leads to it (DERIVATIONS.md, "The oracle's bounds": each rounding is at most u
relative, and to first order their errors add along the chain). The chain is the model's own: every
forward tensor from the embedding to the loss, then every backward tensor from the loss to the
gradient. Counting it by hand as "two per block" missed what a block rounds inside itself — the
MLP's hidden and its activation, attention's q, k, v and probabilities, each op's gradient in
backward — and held a correct bf16 run to a bound it crossed (1.1 to 2.4x at steps after the first).

`depths` runs one forward and backward under a dispatch mode that tags every tensor with the most
roundings on any chain that produced it: an op's output carries the most of its inputs', plus one
where the op rounds. Which ops round: in a bf16 graph, any op computing a bf16 result that is not an
exact rearrangement or copy (views, cat, index, transpose, ... round nothing; a cast from fp32 to
bf16 does). In an fp32 graph that stands for code whose precision it cannot see (Lab.verify: the
user's parallelize may cast anything), `every_op=True` counts every op that computes, which is at
least as many as any bf16 version of it rounds.
"""

from __future__ import annotations

EXACT = frozenset(
    {
        "alias",
        "as_strided",
        "cat",
        "clone",
        "constant_pad_nd",
        "contiguous",
        "copy",
        "copy_",
        "detach",
        "embedding",
        "empty",
        "empty_like",
        "empty_strided",
        "expand",
        "fill",
        "fill_",
        "flip",
        "gather",
        "index",
        "index_put",
        "index_put_",
        "index_select",
        "lift_fresh",
        "lift_fresh_copy",
        "masked_fill",
        "masked_fill_",
        "narrow",
        "neg",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "ones",
        "ones_like",
        "permute",
        "repeat",
        "roll",
        "scatter",
        "select",
        "select_backward",
        "slice",
        "slice_backward",
        "split",
        "split_with_sizes",
        "squeeze",
        "stack",
        "t",
        "transpose",
        "tril",
        "triu",
        "unbind",
        "unfold",
        "unsqueeze",
        "view",
        "_unsafe_view",
        "where",
        "zero_",
        "zeros",
        "zeros_like",
        "_reshape_alias",
        "reshape",
        "expand_as",
        "view_as",
        "unflatten",
        "flatten",
        "sort",
        "topk",
        "argsort",
        "max",
        "min",
        "amax",
        "amin",
        "abs",
        "relu",
        "threshold_backward",
        "scalar_tensor",
        "arange",
        "full",
        "full_like",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_not",
        "logical_and",
        "logical_or",
        "bitwise_not",
        "_to_copy",
        "to",
        "lt_",
        "sign",
        "isfinite",
        "isnan",
        "any",
        "all",
        "nonzero",
        "bincount",
        "argmax",
        "_wrap_tensor_autograd",
        # collectives and FSDP2's buffers that move values (a reduction sums: it rounds, not listed)
        "all_gather_into_tensor",
        "allgather_",
        "_allgather_base_",
        "allgather_into_tensor_coalesced_",
        "wait_tensor",
        "broadcast",
        "broadcast_",
        "all_to_all_single",
        "alltoall_base_",
        "all_gather_copy_in",
        "split_with_sizes_copy",
        "chunk_cat",
        "_foreach_copy_",
        "unsafe_split",
        "alias_copy",
        "view_copy",
        "as_strided_copy",
        "set_",
        "resize_",
        "detach_",
    }
)
"""aten ops whose result is its inputs' values rearranged, copied, selected or compared: no rounding.
`_to_copy` is the one cast: it rounds where it narrows (fp32 -> bf16), which `_rounds` checks apart."""


def _narrows(args, out) -> bool:
    import torch

    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return src is not None and src.is_floating_point() and torch.finfo(out.dtype).bits < torch.finfo(src.dtype).bits


def _storage(t) -> int | None:
    """The address of the storage `t` (or a DTensor's local tensor) views; None for a tensor with none
    (a fake or meta tensor)."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):
        return None


def _counted(t) -> bool:
    import torch

    return isinstance(t, torch.Tensor) and t.is_floating_point()


def depths(module, step, every_op: bool = False) -> dict[str, int]:
    """{parameter name: the most roundings on a chain to its gradient} after `step(module)` runs one
    forward and backward of `module` (its parameters' .grad filled). The parameters themselves start at
    one rounding in a bf16 graph (the masters rounded into the compute weights), at none in fp32."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakTensorKeyDictionary

    low = (torch.bfloat16, torch.float16)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.depth = WeakTensorKeyDictionary()
            self.most = 0  # the deepest chain to any tensor the mode saw made
            self.storages: dict[int, int] = {}  # storage -> the deepest chain to a tensor the mode saw in it

        def of(self, t) -> int:
            """t's depth; a DTensor the mode never saw made (DTensor.from_local wraps a local tensor without
            an op) has its local tensor's; any other unseen tensor is as deep as anything made so far: it
            came from the step, by a path the count cannot follow."""
            if t in self.depth:
                return self.depth[t]
            local = getattr(t, "_local_tensor", None)
            if local is not None and local in self.depth:
                return self.depth[local]
            # a view made where the mode cannot see (FSDP2's flat shards of the parameters): the deepest
            # tensor the mode saw in its storage (a freed storage's address reused keeps the larger)
            held = self.storages.get(_storage(t))
            if held is not None:
                return held
            return self.most

        def note(self, t) -> None:
            key = _storage(t)
            if key is not None:
                self.storages[key] = max(self.storages.get(key, 0), self.depth[t])

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat_in, _ = tree_flatten((args, kwargs or {}))
            before = max((self.of(t) for t in flat_in if _counted(t)), default=0)
            name = func.overloadpacket.__name__
            # what the op made, and what it wrote into (an in-place op, a collective's output argument)
            schema = func._schema.arguments
            written = [a for a, s in zip(args, schema) if s.alias_info is not None and s.alias_info.is_write]
            for t in tree_flatten(out)[0] + tree_flatten(written)[0]:
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    continue
                if name in ("_to_copy", "to", "copy_", "copy"):
                    rounds = _narrows(flat_in, t)
                else:
                    rounds = name not in EXACT and (every_op or t.dtype in low)
                self.depth[t] = max(self.depth.get(t, 0), before + int(rounds))
                self.most = max(self.most, self.depth[t])
                self.note(t)
                local = getattr(t, "_local_tensor", None)  # a DTensor's: its local ops ran where the mode cannot see
                if local is not None:
                    self.depth[local] = self.depth[t]
            return out

    params = dict(module.named_parameters())
    counter = Count()
    for p in params.values():
        counter.depth[p] = 0 if every_op or p.dtype not in low else 1
        counter.note(p)
    for b in module.buffers():  # known before the step: made by no chain of it
        counter.depth[b] = 0
        counter.note(b)
    with counter:
        step(module)
    # a gradient the mode did not see made (stolen into .grad by another path): its local tensor's, else the
    # deepest chain of the whole step, to be safe (Count.of)
    return {n: counter.of(p.grad) if p.grad is not None else 0 for n, p in params.items()}
