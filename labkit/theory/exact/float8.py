"""What fp8 training (precision='fp8': engines/float8.py) adds to a rank's bytes, predicted: the
float8 all-gathers (one byte a weight element), each weight's scale and the all-reduces that
agree on the amaxes, and the fp8 operands saved for backward. DERIVATIONS.md, "FP8 training",
derives each term; everything else an fp8 layout holds and sends is bf16's (layout/precision.py
ELEM: activations, gradients, stage messages and the compute weights stay bf16).

The terms, per rank and step:
  FSDP / ZeRO-3 (ours)  a unit's fp8 weights in a buffer of their own (layout/flat.py FlatLayout.fp8),
                        gathered and held (its shard) at one byte an element; one all-reduce (MAX) of
                        k fp32 amaxes per group of such buffers (k: the weights they hold), at the first
                        gather of the step (engines/float8.py WeightScales)
  FSDP2                 each unit's one all-gather carries its fp8 weights' rows at one byte
                        (torchao's fsdp_pre_all_gather) beside the others' bf16; one all-reduce of k
                        amaxes per step (precompute_float8_dynamic_scale_for_fsdp)
  TP (ours)             per step one all-reduce of the rank's k split fp8 weights' amaxes; per layer and
                        microbatch a scalar all-reduce for each split operand: a row-parallel layer's
                        input (forward), a column-parallel layer's output gradient (backward), and
                        under SP the module input cast before its all-gather, which then moves one
                        byte an element (torchao's PrepareFloat8ModuleInput)
  activations (TP)      a row-parallel layer saves its input in fp8 (1 byte + its 4-byte scale), and
                        under SP the gathered inputs of the attention and the MLP are fp8 too
  activations (FSDP2)   the step's precomputed scales (4 bytes a weight), held by the saved fp8 weights
"""

from __future__ import annotations

from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.float8 import SCALE_BYTES, float8_weights
from labkit.layout.precision import ELEM, GATHER
from labkit.layout.tensor import tp_styles
from labkit.theory.exact.model import param_shapes

AMAX = 4
"""Bytes of one amax in its all-reduce: fp32 (engines/float8.py `_amax`)."""


def tensorwise(cfg: ParallelConfig) -> bool:
    """fp8 with one scale per tensor: the recipe whose weights and SP inputs travel in fp8."""
    return cfg.numerics.fp8 and cfg.fp8_scaling.gathers_fp8


@lru_cache(maxsize=1024)
def gathered_fp8(cfg: ParallelConfig, model: ModelConfig) -> frozenset[str]:
    """The weights ZeRO-3 / FSDP gather in fp8 (ours and FSDP2's): every fp8 layer's, tensorwise."""
    if not (tensorwise(cfg) and cfg.sharded.params):
        return frozenset()
    return frozenset(float8_weights(param_shapes(model)))


def gather_elem(cfg: ParallelConfig, fp8: bool) -> int:
    """Bytes of a gathered element: one for an fp8 weight (layout/precision.py GATHER), else ELEM."""
    return GATHER[cfg.precision] if fp8 else ELEM[cfg.precision]


def amax_rows(buffers, layout) -> list[tuple]:
    """(dim, op, payload bytes, group size, calls) of our units' amax all-reduces in one step: one per
    group of fp8 buffers, k fp32 amaxes (every weight of those buffers) each."""
    groups: dict[tuple, int] = {}
    for p in buffers:
        if p.fp8:
            groups[p.dims] = groups.get(p.dims, 0) + len(p.names)
    return [(layout.label(*dims), "all_reduce", AMAX * k, layout.size(*dims), 1) for dims, k in groups.items()]


def fsdp2_saved_scales(cfg: ParallelConfig, model: ModelConfig) -> int:
    """FSDP2 gathering in fp8: the weights its matmuls save are Float8TrainingTensors whose scales are
    views of the step's one (k,) fp32 tensor of precomputed scales, kept with them from the first
    forward to the last backward; their bytes are parameters, its 4k bytes are not."""
    return SCALE_BYTES * len(gathered_fp8(cfg, model)) if cfg.torch_impl else 0


# -- tensor parallelism ---------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def tp_block(cfg: ParallelConfig, model: ModelConfig) -> dict[str, dict]:
    """One block's TP styles under fp8 (tensorwise; layout/tensor.py marks the fp8 layers and the SP
    inputs gathered in fp8), by the name inside the block; {} where TP carries no fp8. Every dense
    block is styled alike: block 0's, of a one-block model (the planner asks at scale)."""
    if not (tensorwise(cfg) and cfg.tp > 1):
        return {}
    styles = tp_styles(model.replace(layers=1), cfg.sequence_parallel, cfg.tp, fp8=True)
    return {n.removeprefix("blocks.0."): s for n, s in styles.items() if n.startswith("blocks.0.")}


def tp_layers(cfg: ParallelConfig, model: ModelConfig) -> dict[str, int]:
    """How many of one block's layers of each kind compute in fp8 under TP: 'colwise', 'rowwise', and
    'gathered' (the SP inputs gathered in fp8)."""
    block = tp_block(cfg, model).values()
    count = lambda kind: sum(1 for s in block if s["style"] == kind and s.get("fp8"))
    gathered = sum(1 for s in block if s.get("input") == "all-gather-fp8")
    return {"colwise": count("colwise"), "rowwise": count("rowwise"), "gathered": gathered}


def tp_weight_amaxes(cfg: ParallelConfig, model: ModelConfig, layers: int) -> int:
    """The fp8 weights a tp rank holds slices of, in `layers` blocks: one amax each, all-reduced once a step."""
    n = tp_layers(cfg, model)
    return (n["colwise"] + n["rowwise"]) * layers


def tp_activation_delta(cfg: ParallelConfig, model: ModelConfig, b: int, s: int) -> int:
    """What fp8 changes in one block's saved bytes under TP (tensorwise), one microbatch of b sequences
    and s positions: a row-parallel layer keeps its input's fp8 cast (1 byte + scale) — wo beside the
    attention kernel's bf16 output, which the kernel keeps anyway; fc2 / down in place of the bf16
    activation only it kept — and each input gathered in fp8 is kept at 1 byte + scale, not e."""
    e, t, out = ELEM[cfg.precision], cfg.tp, 0
    widths = {"attn.wo": model.heads * model.head_dim // t, "mlp.fc2": model.ffn // t, "mlp.down": model.ffn // t}
    for name, style in tp_block(cfg, model).items():
        if style["style"] == "rowwise" and style.get("fp8"):
            fp8 = b * s * widths[name] + SCALE_BYTES
            # wo's bf16 input is the kernel's own saved output (a view): kept anyway; fc2's / down's is not
            out += fp8 if name == "attn.wo" else fp8 - e * b * s * widths[name]
        if style.get("input") == "all-gather-fp8":  # (b, s, h) kept in fp8, not bf16
            out += b * s * model.hidden + SCALE_BYTES - e * b * s * model.hidden
    return out
