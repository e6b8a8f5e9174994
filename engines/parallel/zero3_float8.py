"""FSDP's float8 all-gather, labkit's own (ZeRO-3 / FSDP units, engines/parallel/zero3.py): a unit's
fp8 linear weights live in a buffer of their own (layout/flat.py `FlatLayout.fp8`) whose shard each
rank holds in fp8 and all-gathers at one byte an element, as torchao's enable_fsdp_float8_all_gather
does for FSDP2 (torchao/float8/fsdp_utils.py `WeightWithDynamicFloat8CastTensor`).

A weight's scale must be its whole tensor's (the one-process model's cast): each rank takes the amax
of its pieces of every weight, one all-reduce (MAX) over the unit's group gives each weight's amax
(torchao's precompute_float8_dynamic_scale_for_fsdp), and each rank casts its pieces with those
scales (engines/float8.py `WeightScales`, once per step). The cast starts from the masters rounded
to bf16, as the reference's bf16 copy does (FSDP2 casts from its fp32 shard).

The unit's parameters stay views of a bf16 buffer that is never allocated again: they hold no
values and only receive their gradients (engines/float8.py `Float8Matmul` returns dw for them),
while forward and backward read the gathered fp8 bytes (`Operands.gathered`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from labkit.engines.float8 import Float8Linear, WeightScales, cast, torchao_float8


def fp8_names(chunks: list[nn.Module], metas) -> frozenset[str]:
    """Full names of the weights of this rank's labkit Float8Linear layers: what the units gather in fp8."""
    return frozenset(
        metas[m.weight].full_name(f"{n}.weight")
        for c in chunks
        for n, m in c.named_modules()
        if isinstance(m, Float8Linear)
    )


def to_fp8_buffers(u, chunks: list[nn.Module], scales_of: WeightScales) -> None:
    """Make unit `u` (zero3._Unit of an fp8 layout) gather in fp8: `full` becomes the (padded,) byte
    buffer, `shard` this rank's bytes, its weights' layers read their gathered views."""
    layout, a, b = u.layout, *u.layout.owned(u.index)
    u.full.untyped_storage().resize_(0)  # the bf16 views' buffer: no values from now on
    u.full = torch.zeros(layout.padded, dtype=torch.uint8, device=u.master.device)  # gathered: (padded,) bytes
    u.nbytes = u.full.untyped_storage().nbytes()
    u.full.untyped_storage().resize_(0)
    u.shard = torch.zeros(b - a, dtype=torch.uint8, device=u.master.device)  # this rank's, cast every step
    names = list(layout.names)
    scales = torch.ones(len(names), dtype=torch.float32, device=u.master.device)  # (k,) this step's
    layer = {id(m.weight): m for c in chunks for m in c.modules() if isinstance(m, Float8Linear)}
    mm = None
    for i, (_, shape, lo, hi) in enumerate(layout.offsets()):
        m = layer[id(u.params[i])]
        m.ops.gathered = partial(_weight, u, lo, hi, shape, scales[i], m.ops.mm)
        m.ops.scales, mm = scales_of, m.ops.mm
    scales_of.add(
        u.group if u.n > 1 else None, [u.master], partial(_amaxes, u, names), partial(_cast_shard, u, names, scales, mm)
    )


def _pieces(u):
    """(weight name, offset in the shard, this rank's bf16 values of it) of each piece in its shard."""
    hp = u.master.to(torch.bfloat16)  # the masters rounded, as the reference's bf16 copy holds them
    return [(name, at, hp[at : at + hi - lo]) for name, _, lo, hi, at in u.layout.pieces(u.index)]


def _amaxes(u, names: list[str]) -> torch.Tensor:
    """(k,) fp32: this rank's amax of each of the unit's k weights (0 where it holds none of it)."""
    out = torch.zeros(len(names), dtype=torch.float32, device=u.master.device)
    for name, _, values in _pieces(u):
        out[names.index(name)] = values.abs().max().float()
    return out


def _cast_shard(u, names: list[str], scales: torch.Tensor, mm, new: torch.Tensor) -> None:
    """Keep the step's scales and cast this rank's pieces with them into its fp8 shard."""
    scales.copy_(new)
    for name, at, values in _pieces(u):
        fp8 = cast(values, "e4m3", "WEIGHT", mm, scale=scales[names.index(name)])._data  # (piece,) e4m3
        u.shard[at : at + values.numel()].copy_(fp8.view(torch.uint8))


def _weight(u, lo: int, hi: int, shape, scale: torch.Tensor, mm):
    """The weight's gathered bytes as torchao's Float8TrainingTensor (out, in), bf16 to the matmul."""
    tt = torchao_float8().tensor
    data = u.full[lo:hi].view(torch.float8_e4m3fn).view(shape)
    return tt.Float8TrainingTensor(data, scale, torch.bfloat16, mm, tt.GemmInputRole.WEIGHT)


def dequantized(u) -> torch.Tensor:
    """The gathered unit as fp32 values, fp8(w·s) / s per weight: what forward reads (the working
    weights the oracle checks). The unit must be gathered."""
    out = torch.zeros(u.layout.padded, dtype=torch.float32, device=u.full.device)
    layer = {id(m.weight): m for m in _layers(u)}
    for i, (_, _, lo, hi) in enumerate(u.layout.offsets()):
        w = layer[id(u.params[i])].ops.gathered()
        out[lo:hi] = w._data.reshape(-1).to(torch.float32) / w._scale
    return out


def _layers(u) -> list[Float8Linear]:
    return [m for mod in u.modules for m in mod.modules() if isinstance(m, Float8Linear)]
