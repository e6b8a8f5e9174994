"""Which parameters Muon updates, and how a stacked expert tensor is taken: the rule, written once, that the
engines, the reference and the theory read (torch-free).

Muon orthogonalizes a matrix that maps features to features (Jordan et al. 2024, "Muon: an optimizer for
hidden layers"): the blocks' linear weights. AdamW keeps what is not such a matrix or not hidden: the token
embedding (a lookup table, not a map), the head (its rows are the output's; Liu et al. 2025, "Muon is
Scalable for LLM Training", section 2.4 keeps the embedding and the head on AdamW, and torch.optim.Muon's
documentation says the same), every norm and bias (1-D), GPT-OSS's sinks, and an MoE router: its rows are
the experts' scores, the input of a top-k, as the head's are the vocabulary's (torchtitan keeps a router in
bf16 beside the head for the same reason: labkit/layout/float8.py FILTER_FQNS).

Experts: a stacked (E, in, out) tensor (engines/moe.py computes x @ w[e]) is E matrices, each
orthogonalized on its own, taken in a Linear's orientation (out, in) = w[e].T, so that adjust_lr's ratio
A/B is out/in as for every other weight (torch.optim._muon._adjust_lr reads param_shape[:2]).
"""

from __future__ import annotations

EXPERT_WEIGHTS = ("mlp.w1", "mlp.w2", "mlp.w3")
"""The routed experts' stacked weights (E, in, out) by their name in the block (engines/moe.py)."""
ADAMW_IN_BLOCKS = ("router", "sinks")
"""Matrices and vectors inside a block that AdamW keeps: the MoE router, GPT-OSS's attention sinks."""


def takes_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether Muon updates the parameter `name` of full shape `shape` (the module docstring's rule)."""
    if not name.startswith("blocks.") or any(f".{n}." in name or name.endswith(f".{n}") for n in ADAMW_IN_BLOCKS):
        return False
    if len(shape) == 3:  # the experts' stack, named by its module alone ('blocks.1.mlp.w1')
        return any(name.endswith("." + w) for w in EXPERT_WEIGHTS)
    return len(shape) == 2


def matrices(name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The (out, in) shape of each matrix Muon orthogonalizes in the parameter: one for a 2-D weight
    (out, in) as stored, E for an expert stack (E, in, out), each transposed."""
    if len(shape) == 3:
        return [(shape[2], shape[1])] * shape[0]
    return [tuple(shape)]
