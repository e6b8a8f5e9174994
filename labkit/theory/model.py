"""The lab model's parameters, by name and shape, without building it (no torch).

Must list exactly what labkit.engines.model.GPT registers, in the same order; a test checks it.
"""

from __future__ import annotations

from functools import lru_cache
from math import prod

from labkit.config import ModelConfig


@lru_cache(maxsize=64)
def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v, s = m.hidden, m.ffn, m.vocab, m.seq
    out = [("embed.tok.weight", (v, h)), ("embed.pos.weight", (s, h))]
    for i in range(m.layers):
        b = f"blocks.{i}."
        out += [(b + "ln1.weight", (h,)), (b + "ln1.bias", (h,))]
        out += [(b + f"attn.{w}.weight", (h, h)) for w in ("wq", "wk", "wv", "wo")]
        out += [(b + "ln2.weight", (h,)), (b + "ln2.bias", (h,))]
        if m.experts:
            # a module's own parameters come before its submodules' (nn.Module.named_parameters)
            out += [
                (b + "mlp.w1", (m.experts, h, f)),
                (b + "mlp.w2", (m.experts, f, h)),
                (b + "mlp.router.weight", (m.experts, h)),
            ]
        else:
            out += [(b + "mlp.fc1.weight", (f, h)), (b + "mlp.fc2.weight", (h, f))]
    out += [("head.norm.weight", (h,)), ("head.norm.bias", (h,)), ("head.proj.weight", (v, h))]
    return tuple(out)


def num_params(m: ModelConfig) -> int:
    """Ψ: every parameter of the full model, counted once."""
    return sum(prod(s) for _, s in param_shapes(m))


def active_params(m: ModelConfig) -> float:
    """Parameters a token passes through: every dense weight, and top_k of each layer's E experts
    (the count that sets the FLOPs of an MoE model, e.g. Mixtral's 13B active of 47B)."""
    if not m.experts:
        return num_params(m)
    expert = sum(prod(s) for n, s in param_shapes(m) if n.endswith(("mlp.w1", "mlp.w2")))
    return num_params(m) - expert + expert * m.top_k / m.experts
