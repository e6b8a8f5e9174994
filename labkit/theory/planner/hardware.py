"""The hardware the time and memory models price a step on: one set of constants per machine, each
with its source (a datasheet, a paper, or a measurement read from benchmarks/gpu_constants_<device>.json
by theory/planner/calibration.py, its rules stated there). No constant is fitted to a published
training run; benchmarks/published.py holds the model against those. A constant with neither a
measurement nor a datasheet is listed in the Hardware's `assumptions` (`labkit plan` prints them).

    rate of a matmul      min(peak · matmul_eff, intensity · hbm · hbm_eff)      (a roofline)
    rate of attention     peak · attention_eff   (flash kernels are compute-bound at these shapes)
    a collective          α · steps + bytes / β on the slowest link its group spans (Hockney)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.config import ConfigError
from labkit.config.choices import numerics
from labkit.theory.planner.calibration import efficiencies, load, load_workspace
from labkit.theory.planner.measured import pace

GiB = 2**30


@dataclass(frozen=True)
class Link:
    alpha: float
    """Latency per message step, seconds."""
    beta: float
    """Bandwidth per GPU in one direction, bytes/s."""


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float
    """Peak dense bf16 FLOP/s per GPU (the datasheet's; MFU is quoted against it)."""
    memory: float
    """Device memory, bytes, as the device reports it (torch.cuda.mem_get_info's total: an
    '80 GB' H100 has 85.0e9 bytes, 79.2 GiB)."""
    gpus_per_node: int
    intra: Link
    """Inside a node (NVLink)."""
    inter: Link
    """Across nodes (InfiniBand / RoCE), per GPU."""
    hbm: float
    """HBM bandwidth, bytes/s (datasheet)."""
    fp8_flops: float = 0.0
    """Peak dense fp8 FLOP/s (0: no fp8 tensor cores)."""
    matmul_eff: float = 0.78
    """Fraction of `flops` a large bf16 matrix product reaches."""
    fp8_matmul_eff: float = 0.66
    """Fraction of `fp8_flops` a large fp8 product (torch._scaled_mm, per-tensor scales) reaches."""
    attention_eff: float = 0.51
    """Fraction of `flops` causal flash attention (forward + backward) reaches at head dim 128 over
    long blocks (8192 keys and more); shorter blocks and head dim 64 run at `attention_shape`."""
    hbm_eff: float = 0.89
    """Fraction of `hbm` an elementwise kernel (copy, add) reaches."""
    context: float = 0.7e9
    """Bytes the CUDA context and library handles (cuBLAS) take, outside PyTorch's allocator."""
    allocator: float = 0.25
    """Reserved minus allocated, as a fraction of the allocated peak (PyTorch's caching allocator
    keeps freed blocks of the step's sizes; what torch.cuda.max_memory_reserved reports)."""
    workspace: float | None = None
    """cuBLAS's workspaces held in PyTorch's allocator through a step (each (handle, stream) a step uses
    keeps one; calibration.load_workspace), bytes; None: not measured, left out of the peak and said so
    in `assumptions` (an H100 step's peak was 135.3 MB above the theory's, 2026-11-26)."""
    nccl_buffer: float = 4 * 2**20
    """NCCL_BUFFSIZE: bytes per channel and direction of each peer connection (NCCL's default)."""
    nccl_channels: int = 16
    """Channels NCCL opens per communicator (its ring/tree count on NVLink + IB nodes)."""
    source: str = ""
    assumptions: tuple[str, ...] = ()
    """The constants with neither a measurement nor a datasheet behind them, each with its value."""
    stack: str = "roofline"
    """The software stack the step runs on (theory/planner/stacks.py): how close its kernels come to
    the isolated rates above is the stack's property, not the device's. 'roofline': at those rates."""
    memory_slowdown: float = 1.0
    """An elementwise kernel's seconds in the stack's step over its bytes at hbm · hbm_eff."""
    optimizer_slowdown: float = 1.0
    """The optimizer step's seconds over its states' bytes at hbm · hbm_eff."""
    memory_pace: tuple[tuple[float, float], ...] = ()
    """(kernel bytes, memory_slowdown) measured at two kernel sizes or more (theory/planner/measured.py):
    an elementwise kernel then runs at the pace of its own size (`slowdown_at`); () : memory_slowdown."""
    copy_slowdown: float = 1.0
    """FSDP's copies around its collectives, their seconds in a measured FSDP step over their bytes at
    hbm · hbm_eff (measured.py `fsdp_paces`); 1: the roofline, while not measured."""

    def slowdown_at(self, kernel_bytes: float) -> float:
        """The stack's pace for an elementwise kernel of `kernel_bytes`."""
        return pace(self.memory_pace, kernel_bytes) if self.memory_pace else self.memory_slowdown

    def peak(self, precision: str) -> float:
        """The dense peak FLOP/s a layout in `precision` computes at: MFU's denominator, so that no
        MFU can pass 100% (fp8 layouts against the fp8 peak; torchtitan quotes its Float8 runs
        against the bf16 peak, which an fp8 step can pass). fp32 layouts are timed as bf16 autocast
        runs them: an assumption (no fp32 rate is kept here). ConfigError, naming this hardware,
        where it has no rate for the precision."""
        if not numerics(precision).fp8:
            return self.flops
        if not self.fp8_flops:
            with_fp8 = ", ".join(k for k, hw in HARDWARE.items() if hw.fp8_flops)
            raise ConfigError(
                [
                    f"precision='fp8' cannot be priced on {self.name}: it has no fp8 rate (no fp8 tensor "
                    f"cores, fp8_flops=0 in labkit/theory/planner/hardware.py); use precision='bf16', "
                    f"or hardware with fp8: {with_fp8}"
                ]
            )
        return self.fp8_flops


UNSOURCED = (
    "intra.alpha 3 us and inter.alpha 8 us: collective latency per step (no measurement or datasheet here)",
    "nccl_channels 16: channels NCCL opens per communicator (not measured here)",
    "attention below 2048 keys: the measured fall per halving extrapolated (measured at 2048 and 8192 keys)",
)
"""The assumptions every profile shares."""
ALPHA_ASSUMED, CHANNELS_ASSUMED = UNSOURCED[:2]
"""The two a measurement on a node's GPUs replaces (theory/planner/stacks.py `measured_links`)."""

MEASURED = load("h100")
"""benchmarks/gpu_constants_h100.json, the H100's efficiencies (calibration.py's rules)."""
MEASURED_H200 = load("h200")
"""benchmarks/gpu_constants_h200.json: the H200 profile's file, read once."""
ALLOCATOR = MEASURED_H200
"""The allocator's reserve comes from the H200's Llama steps (calibration.py), for every profile."""
MEASURED_H100 = f"{MEASURED.path} ({MEASURED.provenance})"


def workspaces(device: str) -> tuple[dict, tuple[str, ...]]:
    """The Hardware fields of `device`'s measured cuBLAS workspaces, and the assumption that says they
    are left out where no measurement exists (calibration.load_workspace)."""
    got = load_workspace(device)
    if got is None:
        return {}, (
            f"cuBLAS's workspaces: not measured on the {device} (benchmarks/gpu_workspace.py), left out of the "
            "allocated peak",
        )
    return {"workspace": float(got[0])}, ()


WORKSPACE_H100, UNMEASURED_H100 = workspaces("h100")
WORKSPACE_H200, UNMEASURED_H200 = workspaces("h200")

H100 = Hardware(
    "H100 SXM 80GB (8/node, NVLink 4 + 400G IB)",
    flops=989e12,
    gpus_per_node=8,
    # NVLink 4's 900 GB/s counts both directions: 450 each way; one 400 Gb/s NIC per GPU is 50 GB/s
    intra=Link(alpha=3e-6, beta=450e9),
    inter=Link(alpha=8e-6, beta=50e9),
    hbm=3.35e12,
    fp8_flops=1979e12,
    # memory, context and the efficiencies read from the measurement, as calibration.py's rules say
    **efficiencies(MEASURED, flops=989e12, fp8_flops=1979e12, hbm=3.35e12, allocator=ALLOCATOR),
    **WORKSPACE_H100,
    source=(
        "NVIDIA H100 datasheet: 989 TFLOP/s dense bf16, 1,979 dense fp8, 3.35 TB/s HBM3, NVLink 4 "
        "900 GB/s (450 each way), one 400 Gb/s NDR NIC per GPU. Measured (" + MEASURED_H100 + "), by "
        "calibration.py's rules: the device's total bytes; the median of the large bf16 and fp8 "
        "products; SDPA causal attention (cuDNN's kernel) at head dim 128 over 8192 keys; copy and "
        "add; the CUDA context with cuBLAS. The allocator's reserve from "
        + ALLOCATOR.path
        + " ("
        + ALLOCATOR.provenance
        + "), so the H100's own Llama steps stay validation rows"
    ),
    assumptions=UNSOURCED + UNMEASURED_H100,
)

H100_GRAND_TETON = Hardware(
    "H100 96GB HBM2e at 500 W (Meta Grand Teton, 8/node, 400G RDMA)",
    flops=912e12,
    memory=102.0e9,
    gpus_per_node=8,
    intra=Link(alpha=3e-6, beta=450e9),
    inter=Link(alpha=8e-6, beta=50e9),
    hbm=2.4e12,
    fp8_flops=1824e12,
    matmul_eff=H100.matmul_eff,
    fp8_matmul_eff=H100.fp8_matmul_eff,
    # FlashAttention-2 on Hopper: 35% of peak (the source below), not the cuDNN kernel measured here
    attention_eff=0.35,
    hbm_eff=H100.hbm_eff,
    context=H100.context,
    allocator=H100.allocator,
    workspace=H100.workspace,
    source=(
        "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e (102.0e9 bytes, the "
        "80 GB H100's reported total scaled by 96/80) at 2.4 TB/s, 500 W power "
        "limit, 400 Gb/s per GPU; its footnote puts the peak 'between SXM and NVL' (989 and 835 "
        "TFLOP/s dense bf16, the H100 and H100 NVL datasheets): the midpoint, 912 (fp8 twice that). "
        "Attention: PyTorch's SDPA of Dec 2024 ran FlashAttention-2 on Hopper, which reaches 35% of "
        "H100 peak (Shah et al., FlashAttention-3, 2024, abstract). Matmul, copy, context and allocator: "
        "the H100 SXM's, as measured here"
    ),
    assumptions=UNSOURCED
    + (
        "flops 912 TFLOP/s: the midpoint of two datasheets (this card was never measured)",
        "memory 102.0e9 bytes: the 80 GB card's reported total scaled by 96/80",
        "attention_eff 0.35: FlashAttention-2's fraction on an H100 from a paper, not this stack's kernel",
        "matmul, fp8, copy efficiencies, context and allocator: the 700 W H100 SXM's, on a 500 W card",
    )
    + UNMEASURED_H100,
)

A100 = Hardware(
    "A100 SXM 80GB (8/node, NVLink 3 + 200G IB)",
    flops=312e12,
    memory=85.0e9,
    gpus_per_node=8,
    intra=Link(alpha=3e-6, beta=300e9),
    # 200 Gb/s HDR per GPU: 25 GB/s
    inter=Link(alpha=8e-6, beta=25e9),
    hbm=2.039e12,
    matmul_eff=H100.matmul_eff,
    attention_eff=0.55,
    hbm_eff=H100.hbm_eff,
    context=0.6e9,
    allocator=H100.allocator,
    source=(
        "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s (300 each "
        "way), 200 Gb/s HDR per GPU; no fp8. Attention: FlashAttention-2 (Dao 2023, section 4.1) "
        "reaches 50-73% of A100 peak forward and backward, its lower half taken (0.55); the matmul, "
        "copy and allocator fractions: the H100's measured ones (not measured on an A100)"
    ),
    assumptions=UNSOURCED
    + (
        "memory 85.0e9 and context 0.6e9 bytes: not measured on an A100",
        "matmul and copy efficiencies, allocator: the H100's measurements",
        "attention_eff 0.55: the lower half of a paper's 50-73% range",
        "cuBLAS's workspaces: not measured on an A100 (a Hopper's are not an Ampere's), left out of the peak",
    ),
)

H200 = Hardware(
    "H200 SXM 141GB (8/node, NVLink 4 + 400G IB)",
    flops=989e12,
    gpus_per_node=8,
    intra=Link(alpha=3e-6, beta=450e9),
    inter=Link(alpha=8e-6, beta=50e9),
    hbm=4.8e12,
    fp8_flops=1979e12,
    # read from its measurement; the allocator's reserve is PyTorch's, from this same file's steps
    **efficiencies(MEASURED_H200, flops=989e12, fp8_flops=1979e12, hbm=4.8e12, allocator=ALLOCATOR),
    **WORKSPACE_H200,
    source=(
        "NVIDIA H200 datasheet: 989 TFLOP/s dense bf16, 1,979 dense fp8, 4.8 TB/s HBM3e, NVLink 4 900 GB/s "
        "(450 each way). Measured (" + MEASURED_H200.path + ", " + MEASURED_H200.provenance + "), by "
        "calibration.py's rules: the device's total bytes, the products, attention, copies, the context"
    ),
    assumptions=UNSOURCED
    + UNMEASURED_H200
    + ("inter 400 Gb/s per GPU: the usual HGX H200 NIC, not this machine's (one GPU)",),
)

HARDWARE = {"h100": H100, "h100-96gb": H100_GRAND_TETON, "a100": A100, "h200": H200}
"""Hardware by the names `evaluate`, `plan` and the CLI take."""


HALVING, HEAD_DIM_64 = MEASURED.attention_shape()
"""Read from the H100's measurement (calibration.Measurement.attention_shape): the flash kernel's
rate lost per halving of the keys below 8192, and head dim 64's rate over head dim 128's."""


def attention_shape(head_dim: int, length: int) -> float:
    """The flash kernel's rate relative to head dim 128 over 8192 keys, as measured on the H100
    (HALVING and HEAD_DIM_64, forward + backward): 1 from 8192 keys on, log-linear below, as
    measured down to 2048 keys (an extrapolation beyond, down to 0.2); head dim 64 at HEAD_DIM_64
    of head dim 128's rate."""
    halvings = max(0.0, math.log2(8192 / max(length, 1)))
    # the rate falls by HALVING for each halving of the block below 8192 keys, floored where unmeasured
    shape = max(0.2, 1.0 - HALVING * halvings)
    return shape * (HEAD_DIM_64 if head_dim <= 64 else 1.0)


def attention_rate(hw: Hardware, head_dim: int, length: int) -> float:
    """FLOP/s of causal flash attention at `head_dim` over blocks of `length` keys."""
    return hw.flops * hw.attention_eff * attention_shape(head_dim, length)


def hardware_of(name_or_hw) -> Hardware:
    """A Hardware, or one of HARDWARE's names."""
    if isinstance(name_or_hw, Hardware):
        return name_or_hw
    try:
        return HARDWARE[name_or_hw]
    except KeyError:
        raise ConfigError([f"hardware={name_or_hw!r} is not known; choose one of {', '.join(HARDWARE)}"]) from None
