"""The planner: which layout for this model on these GPUs.

    theory.evaluate(cfg, model, hardware="h100") -> Plan          # one layout, priced
    theory.plan(model, gpus, hardware="h100", global_batch=..., top=10) -> list[Plan]

A Plan is the fullest rank's memory, term by term (theory/planner/gpu_memory.py), and the step's time
(theory/planner/timing.py) on one hardware (theory/planner/hardware.py). `plan` enumerates dp x tp x pp x cp x ep
meshes (pipelines 1F1B or interleaved, uneven stages where the layers do not split evenly),
sharding, sequence parallelism, the microbatch size, checkpointing and precision; it prunes by
memory before timing (the fastest checkpointing that fits is the only one timed: recomputation
only adds time) and ranks what fits by predicted tokens/s/GPU. What it rejects is counted by
reason, with the nearest misses kept (`.rejected`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.config import ConfigError, ModelConfig, ParallelConfig
from labkit.config.validation import argument_problems, problems
from labkit.theory.planner.gpu_memory import (
    allocated_at,
    allocated_bytes,
    memory_terms,
    outside_allocations,
    peak_bytes,
    required,
    required_bytes,
    reserved_bytes,
)
from labkit.theory.planner.hardware import Hardware, hardware_of
from labkit.theory.planner.links import link_traffic
from labkit.theory.planner.stacks import with_stack
from labkit.theory.planner.stages import fullest_candidates
from labkit.theory.planner.timing import StepTime, step_time


@dataclass
class Plan:
    """One layout of one model on one hardware, predicted."""

    config: ParallelConfig
    model: ModelConfig = field(repr=False)
    hardware: str
    peak_bytes: float
    """Everything the fullest GPU holds at its peak (reserved + CUDA context + NCCL)."""
    step_seconds: float
    tokens_per_second_per_gpu: float
    mfu: float
    """Model FLOPs utilisation (PaLM's 6N + 12·L·h·s per token) against the dense peak of the
    layout's precision: bf16's, fp8's for an fp8 layout (Hardware.peak), so never above 100%."""
    bound: str
    """'compute', 'memory' or the mesh dim whose exposed communication dominates the step."""
    breakdown: dict = field(repr=False)
    """'memory': the fullest rank's bytes by term (gpu_memory.TERMS) with 'allocated',
    'reserved', 'peak', 'required' and 'pp_rank'; 'time': seconds of compute, bubble, optimizer, exposed
    communication per dim, recompute; 'comm': seconds of each dim's collectives."""
    fits: bool = True
    """The allocated peak, the CUDA context and NCCL's buffers fit in the device
    (gpu_memory.required_bytes: the allocator gives its cache back before it fails)."""
    why: str = ""
    """Why it does not fit, with the numbers; empty when it fits."""
    tight: bool = False
    """Fits, but not with the allocator's usual reserve (peak_bytes is over the device): it runs
    with the allocator freeing its cache and retrying (torch.cuda.memory_stats'
    num_alloc_retries), which the predicted time leaves out; the planner ranks it after every
    plan that is not tight."""
    stack: str = "roofline"
    """The software stack the time is priced for (theory/planner/stacks.py)."""
    hw: Hardware | None = field(default=None, repr=False, compare=False)
    """The hardware itself (its links: `links`); `hardware` is its name."""

    @property
    def memory(self) -> dict:
        return self.breakdown["memory"]

    def layout(self) -> str:
        return describe(self.config)

    def links(self):
        """Rows: what each mesh dim of the busiest rank sends per step, over NVLink and across nodes
        (theory/planner/links.py)."""
        return link_traffic(self.config, self.model, self.hw or self.hardware)

    def __str__(self) -> str:
        fit = "" if self.fits else f"  (does not fit: {self.why})"
        fit = fit or ("  (tight: fits once the allocator gives back its cache)" if self.tight else "")
        return (
            f"{self.layout()}: {self.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, MFU {self.mfu:.1%}, "
            f"{self.peak_bytes / 2**30:,.1f} GiB, {self.bound}-bound{fit}"
        )


def describe(c: ParallelConfig) -> str:
    """A layout in one line: 'fsdp 8 · tp 8 · pp 4 · interleaved v2 · m 16 × 1 seq · SP · AC full · fp8'
    (the data-parallel degree named by its sharding)."""
    dims = [f"{d} {getattr(c, d)}" for d in ("dp", "tp", "pp", "cp", "ep") if getattr(c, d) > 1] or ["1 GPU"]
    # the dp degree named by its sharding ('fsdp 8'), as the frameworks' tables name it
    if c.sharded.optimizer and dims[0].startswith("dp"):
        dims[0] = f"{c.sharding} {c.dp}"
        if c.dp_replicate > 1:  # HSDP: shard groups of dp / dp_replicate, replicated across
            dims[0] = f"{c.sharding} {c.dp // c.dp_replicate} × {c.dp_replicate} replicas"
    if c.cp > 1 and not (c.context.ring and not c.context.splits_heads):  # a cp kind other than the ring
        at = next(i for i, d in enumerate(dims) if d.startswith("cp "))
        dims[at] += f" {c.cp_kind}" + (f" a2a {c.cp_a2a}" if c.context.hierarchical else "")
    if c.pp > 1:
        dims.append(c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else ""))
    # m microbatches of global_batch / (dp·ep·m) sequences each
    dims.append(f"m {c.microbatches} × {c.global_batch // (c.dp * c.ep * c.microbatches)} seq")
    if c.sequence_parallel:
        dims.append("SP")
    if c.recomputation.recomputes:
        dims.append(f"AC {c.recompute}")
    dims.append(c.precision)
    if c.stage_layers:
        dims.append("stages " + _runs(c.stage_layers))
    return " · ".join(dims)


def _runs(sizes: tuple[int, ...]) -> str:
    """(15, 16, 16, 16, 15) -> '15/16x3/15'."""
    out: list[list[int]] = []
    for n in sizes:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([n, 1])
    return "/".join(f"{n}x{k}" if k > 1 else str(n) for n, k in out)


def layout_problems(cfg: ParallelConfig, model: ModelConfig) -> list[str]:
    """What makes `cfg` impossible for `model` as arithmetic (the validation's checks), leaving
    out the refusals that concern labkit's own engines only: ZeRO-2/3 and FSDP under a pipeline
    (which production frameworks run: torchtitan's FSDP x PP) and impl='torch'."""
    changes: dict = {"impl": "lab"} if cfg.torch_impl else {}
    if cfg.pp > 1 and cfg.sharded.grads:
        # ZeRO-1's arithmetic; reshard_after_forward is FSDP's alone, so it goes back to its default
        changes |= {"sharding": "zero1", "reshard_after_forward": True}
    # one replace at most: a config's construction checks every field (the search calls this per layout)
    return problems(cfg.replace(**changes) if changes else cfg, model)


def evaluate(
    cfg: ParallelConfig, model: ModelConfig, hardware: str | Hardware = "h100", stack: str | None = None
) -> Plan:
    """The predicted memory and time of `cfg` on `model` on one hardware (a name of
    theory.hardware.HARDWARE, or a Hardware) under a software stack (stacks.STACKS: 'eager'
    PyTorch, 'compile', or 'roofline', the kernels' isolated rates; None: the layout's own,
    'compile' where cfg.compile, else 'eager'). Raises ConfigError for a layout that cannot be
    laid out; one that does not fit comes back with fits=False and the reason."""
    if not (isinstance(cfg, ParallelConfig) and isinstance(model, ModelConfig)):
        raise ConfigError(argument_problems("evaluate", cfg, model))
    hw = with_stack(hardware_of(hardware), stack or ("compile" if cfg.compile else "eager"))
    found = layout_problems(cfg, model)
    if found:
        raise ConfigError(found)
    hw.peak(cfg.precision)  # refuses a precision the hardware has no rate for, naming the hardware
    return _evaluate(cfg, model, hw)


def fullest(cfg: ParallelConfig, model: ModelConfig, hw: Hardware) -> dict:
    """The memory terms of the rank that holds the most (over the pipeline's ranks)."""
    # the fullest rank is not known ahead: each candidate priced, the one that needs the most kept
    st = max(fullest_candidates(cfg, model), key=lambda st: required(cfg, model, hw, st))
    best = {**memory_terms(cfg, model, hw, st), "pp_rank": st.rank}
    best["allocated"] = allocated_bytes(best)
    best["reserved"] = reserved_bytes(best)
    best["peak"] = peak_bytes(best)
    best["required"] = required_bytes(best)
    return best


def fullest_required(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, ac) -> float:
    """The fullest rank's required bytes under checkpointing `ac` (the search's question)."""
    # what the candidates share (the CUDA context, NCCL's buffers, cuBLAS's workspaces) once, their allocations each
    return max(allocated_at(cfg, model, st, ac) for st in fullest_candidates(cfg, model)) + outside_allocations(cfg, hw)


def _evaluate(cfg: ParallelConfig, model: ModelConfig, hw: Hardware, memory: dict | None = None) -> Plan:
    memory = memory or fullest(cfg, model, hw)
    t: StepTime = step_time(cfg, model, hw)
    # the step's tokens over its time and the whole world: per GPU, as published runs report it
    tokens = cfg.global_batch * model.seq / (t.total * cfg.world)
    breakdown = {
        "memory": memory,
        "time": {
            "compute": t.compute,
            "recompute": t.parts.get("recompute", 0.0),
            "bubble": t.bubble,
            "optimizer": t.optimizer,
            **{f"exposed {d}": x for d, x in t.exposed.items()},
        },
        "comm": dict(t.comm),
        "step": t,
    }
    # fits on the required bytes, not the reserved: the allocator frees its cache and retries first
    fits = memory["required"] <= hw.memory
    why = "" if fits else _over(memory["required"], hw)
    # fits, but only once the allocator has given back its cache (a retry the time leaves out)
    tight = fits and memory["peak"] > hw.memory
    return Plan(
        cfg,
        model,
        hw.name,
        memory["peak"],
        t.total,
        tokens,
        t.mfu,
        t.dominant,
        breakdown,
        fits,
        why,
        tight,
        hw.stack,
        hw,
    )


def _over(peak: float, hw: Hardware) -> str:
    return f"needs {peak / 1e9:,.1f} GB of {hw.memory / 1e9:,.0f} GB (+{(peak - hw.memory) / 1e9:,.1f} GB)"
