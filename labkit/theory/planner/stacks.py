"""The software stack a step runs on, priced by name: how close a training step comes to
its kernels' isolated rates is a property of the stack (eager PyTorch, torch.compile), not of the
device, so it is an input a run states (`theory.evaluate(..., stack=...)`, `theory.plan(...,
stack=...)`, published.Run.stack) and each stack's numbers are measured.

    roofline   every kernel at the hardware's isolated rates (hardware.py)
    eager      PyTorch eager: the elementwise kernels and the optimizer as measured in eager steps
    compile    torch.compile: the same, measured in compiled steps
    te         Megatron-Core with Transformer Engine's fused kernels: not measured here yet, so
               priced at the compile stack's pace, and that assumption named in the plan's assumptions

Measured from benchmarks/data/gpu-h200-2026-11-26/mfu.json (calibration.load_kernels): one-process
steps of GPT-2 124M (eager and compiled) and Llama 3.2 1B (eager) on an H200, their kernel seconds
by kind from the profiler. Each step is priced here on the H200's profile at the roofline, op by op
as timing.py prices it; a stack's slowdowns are the median over its steps of
  memory_slowdown     the profiler's 'other' kernels (everything but matmuls, attention and the
                      optimizer) over the seconds the model gives its elementwise ops
  optimizer_slowdown  the profiler's optimizer kernels over the model's optimizer seconds (the
                      median over every step: fused AdamW is the same kernel in both stacks)
Applied to every hardware (an assumption: measured on one device, as ratios to its own rates).
The matmuls and attention are left at their isolated rates: in the Llama step the profiler's
matmul and attention seconds are within 2% and 10% of the model's. FSDP's copies around its
collectives stay at the roofline (not measured in a step).
"""

from __future__ import annotations

import dataclasses
import statistics
from functools import cache

from labkit.config import ConfigError, ParallelConfig
from labkit.theory.planner import measured
from labkit.theory.planner.calibration import load_kernels
from labkit.theory.planner.hardware import ALPHA_ASSUMED, CHANNELS_ASSUMED, H200, Hardware, Link
from labkit.theory.planner.ops import block_ops, embed_ops, head_ops
from labkit.theory.planner.overlap import DataParallel
from labkit.theory.planner.stages import distinct
from labkit.theory.planner.timing import op_seconds, step_time
from labkit.theory.presets import PRESETS

STACKS = ("eager", "compile", "te", "roofline")
"""The stacks a run can state; 'eager' is what evaluate and plan assume unless told."""
PRICED_AS = {"te": "compile"}
"""A stack not yet measured, priced as a measured one: Transformer Engine fuses the elementwise kernels
(bias, activation, norm, dropout) that torch.compile fuses, and its runs' published tokens/s land within
20% of the compiled stack's prediction where eager's are 20-30% pessimistic."""
MEASURED_AS = {"one eager": "eager", "one compiled": "compile"}
"""benchmarks/gpu_mfu.py's row names, by the stack they ran."""


def _model(row: dict):
    """A measured step's model: the preset at the row's sequence, cut to row['layers'] where given."""
    return PRESETS[row["model"]].replace(seq=row["seq"], **({"layers": row["layers"]} if row.get("layers") else {}))


def _memory_ops(row: dict):
    """(op, how many of it) of a measured step's elementwise kernels: the row's model, its batch, bf16."""
    model, b = _model(row), row["batch"]
    for ops, n in (
        (block_ops(model, 1, 1, False, b, "bf16"), model.layers),
        (head_ops(model, 1, 1, False, b, "bf16"), 1),
        (embed_ops(model, 1, 1, False, b, "bf16"), 1),
    ):
        yield from ((op, n) for op in ops if op.kind == "memory")


def priced(row: dict, hw: Hardware = H200) -> tuple[float, float]:
    """(the elementwise ops' seconds, the optimizer's) the model gives a measured step at the roofline of
    `hw` (the H200's: the device of the steps `slowdowns` reads; a new point's own device for its own)."""
    # forward and backward of the elementwise kernels only: matmuls and attention are the profiler's own kinds
    memory = sum(n * (op_seconds(op, hw)[0] + op_seconds(op, hw, op.backward)[0]) for op, n in _memory_ops(row))
    cfg = ParallelConfig(dp=1, global_batch=row["batch"], precision="bf16")
    return memory, step_time(cfg, _model(row), hw).optimizer


def fsdp_copy_seconds(row: dict, hw: Hardware) -> float:
    """The seconds the time model gives FSDP2's copies around its collectives (overlap.py `copy_bytes`) in a
    measured step of row['world'] ranks, row['batch'] sequences each, at the roofline of `hw`."""
    cfg = ParallelConfig(dp=row["world"], global_batch=row["batch"] * row["world"], precision="bf16", sharding="fsdp")
    cfg = cfg.replace(impl="torch")
    st = distinct(cfg, _model(row))[0]
    return DataParallel(cfg, _model(row), hw).copy_bytes(st, per_step=False) / (hw.hbm * hw.hbm_eff)


def kernel_bytes(row: dict) -> float:
    """The size of a measured step's elementwise kernels, as one number, what a pace point is filed
    under: the byte-weighted mean (sum of bytes² over sum of bytes, forward and backward) of a block's.
    The blocks' kernels, not the loss's: those are a few kernels of b·s·V elements (10 GB for GPT-2's
    step) that would set the mean alone; priced, each kernel still gets the pace of its own size."""
    ops = [op for op in block_ops(_model(row), 1, 1, False, row["batch"], "bf16") if op.kind == "memory"]
    return sum(op.bytes**2 * (1 + op.backward) for op in ops) / sum(op.bytes * (1 + op.backward) for op in ops)


@cache
def slowdowns(stack: str) -> tuple[float, float, str]:
    """(memory_slowdown, optimizer_slowdown, their source) of a measured stack."""
    rows = load_kernels()
    mine = [r for r in rows if MEASURED_AS.get(r["what"]) == stack]
    memory = statistics.median(r["kernels"]["kernel_s"]["other"] / priced(r)[0] for r in mine)
    optimizer = statistics.median(r["kernels"]["kernel_s"]["optimizer"] / priced(r)[1] for r in rows)
    steps = ", ".join(f"{r['model']} {r['what']}" for r in mine)
    return memory, optimizer, f"{rows[0]['source']}: {steps}"


def with_stack(hw: Hardware, stack: str) -> Hardware:
    """`hw` as a step on `stack` runs it; ConfigError naming the stacks for any other name."""
    if stack not in STACKS:
        raise ConfigError([f"stack={stack!r} is not one of {list(STACKS)}; pick one of those (eager: PyTorch eager)"])
    hw = measured_links(hw)
    if stack == "roofline":
        return dataclasses.replace(hw, stack=stack, memory_slowdown=1.0, optimizer_slowdown=1.0)
    memory, optimizer, source = slowdowns(PRICED_AS.get(stack, stack))
    measured_on = (
        f"the {stack} stack's pace (elementwise kernels x{memory:.2f}, optimizer x{optimizer:.2f}) measured on "
        f"{source.split(' (')[0]}'s device, applied to this hardware"
    )
    if stack in PRICED_AS:
        measured_on = (
            f"the {stack} stack (Megatron-Core's Transformer Engine kernels) priced at the {PRICED_AS[stack]} "
            f"stack's measured pace (elementwise kernels x{memory:.2f}, optimizer x{optimizer:.2f}): not measured "
            "on a GPU yet"
        )
    paces, said = measured_paces(PRICED_AS.get(stack, stack))
    return dataclasses.replace(
        hw,
        stack=stack,
        memory_slowdown=memory,
        optimizer_slowdown=optimizer,
        **paces,
        assumptions=hw.assumptions + (measured_on, *said),
    )


def measured_paces(stack: str) -> tuple[dict, tuple[str, ...]]:
    """The Hardware fields theory/planner/measured.py's points give `stack` (its pace per kernel size, FSDP's
    copies in a step), and what is assumed for each that was not measured."""
    fields, said = {}, []
    points = measured.pace_points(stack)
    if points:
        fields["memory_pace"] = points
        ends = " to ".join(f"x{p:.2f} at {b / 1e6:,.1f} MB" for b, p in (points[0], points[-1]))
        said.append(f"the {stack} stack's elementwise pace per kernel size, measured at {len(points)} sizes: {ends}")
    else:
        said.append(
            f"the {stack} stack's pace per kernel size: not measured at two sizes "
            "(benchmarks/data/planner_measurements.json 'eager_pace'), one pace for every size"
        )
    fsdp = measured.fsdp_paces(stack)
    if fsdp:
        fields["copy_slowdown"] = fsdp["copy_slowdown"]
        paces = ", ".join(
            f"{k.split('_')[0]} x{fsdp[k]:.2f}" for k in ("copy_slowdown", "memory_slowdown", "optimizer_slowdown")
        )
        said.append(f"inside an FSDP step ({fsdp['source']}): {paces}; only the copies' pace is applied")
    else:
        said.append("FSDP's copies around its collectives: not measured in a step, priced at the roofline")
    return fields, tuple(said)


def measured_links(hw: Hardware) -> Hardware:
    """`hw` with NCCL's latency per ring step inside a node and its channels where measured on a node's
    GPUs, one rank each (measured.py); each such measurement replaces its assumption."""
    latency, channels = measured.nccl_latency(), measured.nccl_channels()
    if latency is None and channels is None:
        return hw
    said = [
        a
        for a in hw.assumptions
        if a not in ((ALPHA_ASSUMED,) if latency else ()) + ((CHANNELS_ASSUMED,) if channels else ())
    ]
    fields = {}
    if latency:
        fields["intra"] = Link(alpha=latency[0], beta=hw.intra.beta)
        said.append(f"inter.alpha {hw.inter.alpha * 1e6:g} us: collective latency per step across nodes, not measured")
    if channels:
        fields["nccl_channels"] = channels[0]
    return dataclasses.replace(hw, **fields, assumptions=tuple(said))
