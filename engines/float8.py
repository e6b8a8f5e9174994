"""Float8 training: the blocks' linear layers compute in fp8, as torchtitan converts a model with
torchao 0.18's float8 training (torchtitan/components/quantization/float8.py; torchao/float8/).

Which layers: labkit/layout/float8.py `converts` (torchtitan's filter: dims multiples of 16, the
head and routers kept bf16). How they compute (torchao's `matmul_with_hp_or_float8_args`): the
input and the weight cast to e4m3, the output's gradient to e5m2, each with a dynamic scale
s = max / amax of the tensor; the three matmuls (output, input gradient, weight gradient) are
`torch._scaled_mm` on one-byte operands, accumulating in fp32 and writing bf16. Activations and
the parameters forward sees are bf16 (engines/precision.py's mixed precision), masters fp32.

Two implementations, one numerics:
  torchao's Float8Linear   the one-process reference (`convert_torchao`) and PyTorch's FSDP2, which
                           all-gathers weights in fp8 (enable_fsdp_float8_all_gather) with scales
                           precomputed once per step (precompute_float8_dynamic_scale_for_fsdp);
  labkit's Float8Linear    every labkit strategy (`convert`): tensorwise, `Float8Matmul`, whose casts
                           know what a strategy split — an operand split over ranks takes its amax over
                           all of them (one all-reduce, MAX), a weight's scale is computed once per step
                           (`WeightScales`), and FSDP's units hand it a weight already gathered in fp8.
                           Rowwise (a scale per row) runs torchao's own matmul: only where no operand is
                           split (labkit.config refuses the rest).
Both save what torchao saves for backward: the bf16 input and weight, cast again in backward; an
input that arrives in fp8 (sequence parallelism's fp8 all-gather) is saved in fp8.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import cache
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.config.float8 import float8_scaling
from labkit.layout.float8 import EPS, MAX, converts


class Torchao(NamedTuple):
    """torchao's float8 modules labkit uses."""

    float8: object  # torchao.float8: Float8LinearConfig, convert_to_float8_training
    linear: object  # float8_linear: Float8Linear, matmul_with_hp_or_float8_args
    tensor: object  # float8_training_tensor: Float8TrainingTensor, hp_tensor_and_scale_to_float8
    fsdp: object  # fsdp_utils: precompute_float8_dynamic_scale_for_fsdp
    tp: object  # float8_tensor_parallel: Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


@cache
def torchao_float8() -> Torchao:
    """torchao's float8 package, imported once per process (~3 s: only fp8 runs pay it). torchao's
    import logs a warning per CUDA kernel library it cannot load on a CPU build, and torch one about
    an Enum it registers: both quieted, they say nothing about float8 training."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        import torchao.float8 as ao
        from torchao.float8 import float8_linear, float8_tensor_parallel, float8_training_tensor, fsdp_utils
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return Torchao(ao, float8_linear, float8_training_tensor, fsdp_utils, float8_tensor_parallel)


def torchao_config(recipe: str, fsdp_all_gather: bool = False):
    """torchao's Float8LinearConfig of `recipe` (from_recipe_name), as torchtitan builds it."""
    ao = torchao_float8().float8
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, enable_fsdp_float8_all_gather=True) if fsdp_all_gather else config


def _filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and converts(fqn, module.out_features, module.in_features)


def convert_torchao(model: nn.Module, recipe: str, fsdp_all_gather: bool = False) -> list[str]:
    """Swap the linear layers that convert for torchao's Float8Linear (convert_to_float8_training
    with torchtitan's filter), in place; returns their names."""
    ao = torchao_float8().float8
    names = [n for n, m in model.named_modules() if _filter(m, n)]
    ao.convert_to_float8_training(model, module_filter_fn=_filter, config=torchao_config(recipe, fsdp_all_gather))
    return names


# -- labkit's float8 linear ---------------------------------------------------------------------
def _amax(x: torch.Tensor, group) -> torch.Tensor:
    """max |x| as fp32, over every rank of `group` when x is split over them (None: this rank's)."""
    amax = x.detach().abs().max().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # () -> the whole tensor's amax
    return amax


def to_scale(amax: torch.Tensor, fmt: str) -> torch.Tensor:
    """s = max / amax in float64, then fp32 (torchao float8_utils.py amax_to_scale)."""
    return (MAX[fmt] / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def cast(x: torch.Tensor, fmt: str, role: str, mm, scale: torch.Tensor | None = None, group=None):
    """x as a torchao Float8TrainingTensor (differentiable: the gradient passes through to x), with
    `scale`, or its own dynamic one (its amax over `group`)."""
    tt = torchao_float8().tensor
    s = to_scale(_amax(x, group), fmt) if scale is None else scale
    return tt.hp_tensor_and_scale_to_float8(x, s, DTYPE[fmt], mm, tt.GemmInputRole[role])


def is_fp8(x: torch.Tensor) -> bool:
    return isinstance(x, torchao_float8().tensor.Float8TrainingTensor)


@dataclass(eq=False)
class Operands:
    """How one fp8 linear's operands are cast, as its strategies set it (defaults: nothing split)."""

    mm: object
    """torchao's LinearMMConfig of the three matmuls (fast accumulation in the forward one)."""
    input_group: object = None
    """The ranks over which the input's features are split (a row-parallel layer's tp group): its amax
    is all-reduced over them before the cast. None: the input is whole here."""
    grad_group: object = None
    """The ranks over which the output's features are split (a column-parallel layer's): the output
    gradient's amax is all-reduced over them. None: whole."""
    weight_scale: torch.Tensor | None = None
    """The weight's scale for this step, a () fp32 that `scales` refreshes in place (when the weight is
    split); None: from the weight itself, in forward and again in backward (torchao)."""
    scales: WeightScales | None = None
    """Where `weight_scale` (or FSDP's cast) is refreshed, at the first forward after an update."""
    gathered: object = None
    """A callable returning the weight already in fp8 (FSDP's float8 all-gather: engines/parallel/
    zero3.py); the parameter then holds no values and only receives the gradient."""


def float8_linear(x: torch.Tensor, w: torch.Tensor, ops: Operands) -> torch.Tensor:
    """x w^T in fp8 (`Float8Matmul`) over x's last dim: (..., in) -> (..., out), bf16."""
    shape = x.shape
    y = Float8Matmul.apply(x.reshape(-1, shape[-1]), w, ops)  # (n, in) -> (n, out)
    return y.view(*shape[:-1], y.shape[-1])  # a view made here, not inside the Function: TP's g sums it in place


class Float8Matmul(torch.autograd.Function):
    """y = x w^T in fp8 on x (n, in), torchao's three matmuls: forward y = x8 w8^T (e4m3 both),
    backward dx = g8 w8 and dw = g8^T x8 (g8: the output gradient in e5m2). Saves x and w as they
    came (bf16, or fp8 if x came in fp8) and casts them again in backward, as torchao does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, ops: Operands):
        # an input split along its features is cast here over the group, and saved in fp8 (torchao's
        # Float8RowwiseParallel casts it before the layer for the same reason)
        if not is_fp8(x) and ops.input_group is not None:
            x = cast(x, "e4m3", "INPUT", ops.mm, group=ops.input_group)
        if ops.scales is not None:
            ops.scales.refresh()  # this step's weight scales: an all-reduce at the step's first forward
        ctx.save_for_backward(x, w)
        ctx.ops = ops
        x8 = x if is_fp8(x) else cast(x, "e4m3", "INPUT", ops.mm)
        return torch.mm(x8, _weight_t(w, ops))  # (n, in) x (in, out) -> (n, out), bf16

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        ops = ctx.ops
        g8 = cast(grad, "e5m2", "GRAD_OUTPUT", ops.mm, group=ops.grad_group)  # (n, out)
        dx = torch.mm(g8, _weight_t(w, ops).t())  # (n, out) x (out, in) -> (n, in)
        x8 = x if is_fp8(x) else cast(x, "e4m3", "INPUT", ops.mm)
        dw = torch.mm(g8.t(), x8)  # (out, n) x (n, in) -> (out, in)
        return dx, dw, None


def _weight_t(w: torch.Tensor, ops: Operands) -> torch.Tensor:
    """w^T in fp8 (in, out), cast as torchao casts weight.t(): with the step's scale, FSDP's gathered
    bytes, or its own amax."""
    if ops.gathered is not None:
        return ops.gathered().t()
    return cast(w.t(), "e4m3", "WEIGHT", ops.mm, scale=ops.weight_scale)


def mm_config(config):
    """torchao's LinearMMConfig of a Float8LinearConfig, as its Float8Linear builds it: per matmul
    (output, input gradient, weight gradient) emulate, fast accumulation, fp8 output, padding."""
    tt = torchao_float8().tensor
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    per_gemm = [tt.ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms]
    return tt.LinearMMConfig(*per_gemm)


class Float8Linear(nn.Linear):
    """An nn.Linear computing in fp8 (labkit's): the same Parameters as the layer it replaced, so
    names, slicing and sharding are unchanged; `ops` is what the strategies set."""

    @classmethod
    def of(cls, linear: nn.Linear, recipe: str) -> Float8Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight, new.bias = linear.weight, linear.bias
        new.config = torchao_config(recipe)  # rowwise: torchao's own matmul reads it
        new.rowwise = float8_scaling(recipe).rowwise
        new.ops = Operands(mm=mm_config(new.config))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rowwise:  # nothing is split under rowwise (labkit.config): torchao's own matmul
            matmul = torchao_float8().linear.matmul_with_hp_or_float8_args
            y = matmul.apply(x, self.weight.t(), self.ops.mm, self.config)
        else:
            y = float8_linear(x, self.weight, self.ops)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def convert(model: nn.Module, recipe: str) -> list[str]:
    """Swap every linear layer that converts (layout/float8.py) for labkit's Float8Linear, in place;
    returns their names. Before any strategy: torchtitan converts at model build, before parallelize."""
    names = [n for n, m in model.named_modules() if _filter(m, n)]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, Float8Linear.of(getattr(owner, attr), recipe))
    return names


# -- scales computed once per step ----------------------------------------------------------------
@dataclass(eq=False)
class _Entry:
    tensors: list[torch.Tensor]
    """What the amaxes are taken from (their version counters say when they changed)."""
    amaxes: object
    """() -> fp32 (k,) this rank's amax of each of the k weights."""
    done: object
    """(scales (k,)) -> None: what the strategy does with the scales (keep them, cast a shard)."""
    seen: list[int] = field(default_factory=list)


class WeightScales:
    """Tensorwise scales of the fp8 weights that strategies split over ranks (TP's slices, FSDP's
    shards): each rank takes the amax of what it holds, and one all-reduce (MAX) per group gives every
    weight's amax, as torchao's precompute_float8_dynamic_scale_for_fsdp does for FSDP2 (one per step,
    after the optimizer). Here lazily, at the first forward after the weights changed (their version
    counters moved): the same values, and every step's collectives the same, the first's included."""

    def __init__(self):
        self.groups: dict[object, list[_Entry]] = {}

    def add(self, group, tensors, amaxes, done) -> None:
        """An entry of k weights: `amaxes()` -> (k,) this rank's, `done(scales (k,))` once they are known;
        `group`: the ranks whose amaxes are MAXed (None: this rank holds them whole)."""
        self.groups.setdefault(group, []).append(_Entry(list(tensors), amaxes, done))

    def track(self, weight: torch.Tensor, group) -> torch.Tensor:
        """One split weight: returns its () fp32 scale, refreshed in place each step."""
        scale = torch.ones((), dtype=torch.float32, device=weight.device)
        self.add(group, [weight], lambda: _amax(weight, None).reshape(1), lambda s: scale.copy_(s[0]))
        return scale

    @torch.no_grad()
    def refresh(self) -> None:
        for group, entries in self.groups.items():
            if all(e.seen == [t._version for t in e.tensors] for e in entries):
                continue
            local = [e.amaxes() for e in entries]
            amax = torch.cat(local)  # (k,) over every entry of the group
            if group is not None:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # (k,) each weight's amax, whole
            scales = to_scale(amax, "e4m3").split([len(a) for a in local])
            for e, s in zip(entries, scales):
                e.done(s)
                e.seen = [t._version for t in e.tensors]
