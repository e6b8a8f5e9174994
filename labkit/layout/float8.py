"""Float8 training's decisions that the engines, the theory and the oracle share (torch-free):
which linear layers compute in fp8, what a scale is, which weights FSDP gathers in fp8, and the
rounding to e4m3 that the oracle re-does in numpy.

The formats (Micikevicius et al., "FP8 Formats for Deep Learning", arXiv:2209.05433, 2022,
table 1): e4m3 (4 exponent bits, 3 mantissa bits, max 448, no infinities: torch.float8_e4m3fn)
for weights and activations, e5m2 (5 and 2, max 57344) for the gradients flowing backward, as
torchao's float8 training casts them (torchao 0.18, float8/config.py: input and weight e4m3,
grad_output e5m2). A tensorwise scale is s = max / amax(x), in float64 then fp32 (torchao
float8_utils.py `amax_to_scale`, amax clamped at EPS), x is cast as fp8(x·s) saturated, and the
matmul divides by both scales (torch._scaled_mm).
"""

from __future__ import annotations

import numpy as np

MAX = {"e4m3": 448.0, "e5m2": 57344.0}
"""The largest finite value of each format (torch.finfo(torch.float8_e4m3fn / float8_e5m2).max)."""
MANTISSA = {"e4m3": 3, "e5m2": 2}
"""Explicit mantissa bits: a normal value in [2^e, 2^(e+1)) lies on a grid of step 2^(e - m)."""
MIN_EXP = {"e4m3": -6, "e5m2": -14}
"""The smallest normal exponent (exponent bias 7 and 15); below 2^MIN_EXP the step stays 2^(MIN_EXP - m)."""
EPS = 1e-12
"""The floor of an amax before 1/amax (torchao float8_utils.py EPS)."""
SCALE_BYTES = 4
"""A scale is one fp32 per tensor (tensorwise): what an fp8 tensor carries beside its bytes."""

BLOCK_LINEARS = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc1", "mlp.fc2", "mlp.gate", "mlp.up", "mlp.down")
"""The nn.Linear modules of a dense block (engines/layers.py Attention, MLP, SwiGLU), by their name
inside the block: the candidates for fp8."""
FILTER_FQNS = ("head", "router")
"""Linear layers kept in bf16 whatever their size, as torchtitan's filter_fqns keeps them
(torchtitan/components/quantization/float8.md: ["output"] for the LM head, "router.gate" for an MoE
router): the head's logits feed the loss, a router's feed a top-k."""


def converts(module: str, out_features: int, in_features: int) -> bool:
    """Whether the nn.Linear named `module` computes in fp8: torchtitan's module_filter_fn
    (torchtitan/components/quantization/utils.py): both dims multiples of 16 (the fp8 tensor cores'
    requirement, kept on the CPU so that a layout converts what it would on an H100), and no name of
    FILTER_FQNS inside the module's name. Judged on the full model, before any TP split."""
    if any(f in module for f in FILTER_FQNS):
        return False
    return out_features % 16 == 0 and in_features % 16 == 0


def block_linears(model) -> dict[str, tuple[int, int]]:
    """(out, in) features of each nn.Linear of a dense block (a ModelConfig), by its name in the block
    (engines/layers.py; the same shapes as theory/exact/model.py param_shapes lists)."""
    h, f = model.hidden, model.ffn
    q, kv = model.heads * model.head_dim, model.n_kv_heads * model.head_dim
    out = {"attn.wq": (q, h), "attn.wk": (kv, h), "attn.wv": (kv, h), "attn.wo": (h, q)}
    if model.family.gated_mlp:
        return {**out, "mlp.gate": (f, h), "mlp.up": (f, h), "mlp.down": (h, f)}
    return {**out, "mlp.fc1": (f, h), "mlp.fc2": (h, f)}


def float8_weights(named_shapes) -> list[str]:
    """Names of the weights of the linear layers that compute in fp8, among (name, full shape) of a
    dense model's parameters (theory/exact/model.py param_shapes)."""
    out = []
    for name, shape in named_shapes:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.endswith(BLOCK_LINEARS) and converts(module, *shape):
            out.append(name)
    return out


def round_e4m3(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to the nearest e4m3 value (ties to even), saturated at ±448, as torch's
    cast to float8_e4m3fn after torchao's clamp (float8_utils.py `to_fp8_saturated`); as fp32."""
    v = np.asarray(values, dtype=np.float64)
    m = MANTISSA["e4m3"]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.abs(v)))
    step = np.exp2(np.maximum(np.where(np.isfinite(e), e, MIN_EXP["e4m3"]), MIN_EXP["e4m3"]) - m)
    q = np.round(v / step) * step  # np.round rounds half to even; v / step is exact (a power of two)
    return np.clip(q, -MAX["e4m3"], MAX["e4m3"]).astype(np.float32)


def tensor_scale(amax: float, fmt: str = "e4m3") -> np.float32:
    """The tensorwise scale of a tensor whose largest |x| is `amax`: max / amax in float64, then fp32."""
    return np.float32(MAX[fmt] / max(float(amax), EPS))


def fp8_weight(values: np.ndarray) -> np.ndarray:
    """What forward reads of a weight gathered in fp8: the bf16 weight `values` (as fp32) cast with
    its tensorwise scale and divided back, fp8(w·s) / s in fp32 (the dequantized fp8 weight)."""
    w = np.asarray(values, dtype=np.float32)
    s = tensor_scale(float(np.max(np.abs(w))) if w.size else 0.0)
    return round_e4m3(w * s) / s
