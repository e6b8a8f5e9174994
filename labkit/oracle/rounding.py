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
    }
)
"""aten ops whose result is its inputs' values rearranged, copied, selected or compared: no rounding.
`_to_copy` is the one cast: it rounds where it narrows (fp32 -> bf16), which `_rounds` checks apart."""


def _narrows(args, out) -> bool:
    import torch

    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return src is not None and src.is_floating_point() and torch.finfo(out.dtype).bits < torch.finfo(src.dtype).bits


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

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat_in, _ = tree_flatten((args, kwargs or {}))
            before = max((self.depth.get(t, 0) for t in flat_in if isinstance(t, torch.Tensor)), default=0)
            name = func.overloadpacket.__name__
            for t in tree_flatten(out)[0]:
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    continue
                if name in ("_to_copy", "to", "copy_", "copy"):
                    rounds = _narrows(flat_in, t)
                else:
                    rounds = name not in EXACT and (every_op or t.dtype in low)
                self.depth[t] = max(self.depth.get(t, 0), before + int(rounds))
            return out

    params = dict(module.named_parameters())
    counter = Count()
    for p in params.values():
        counter.depth[p] = 0 if every_op or p.dtype not in low else 1
    with counter:
        step(module)
    deepest = max((counter.depth.get(p.grad, 0) for p in params.values() if p.grad is not None), default=0)
    # a gradient the mode did not see made (stolen into .grad by another path): the deepest, to be safe
    return {n: counter.depth.get(p.grad, deepest) if p.grad is not None else 0 for n, p in params.items()}
