"""A simple time model: which part of a step dominates, at any scale.

Compute: 6·Ψ·tokens FLOPs per step for forward + backward (Kaplan et al. 2020, section 2.1;
8·Ψ·tokens with full activation recomputation, which repeats the forward), spread over the
ranks and run at `mfu` of the device's peak.

Communication: each collective costs α + bytes/β (Hockney's model) on the slowest link its
group crosses: a group whose ranks sit on one node uses the intra-node link (NVLink), one
that spans nodes the inter-node link (InfiniBand / RoCE), given `gpus_per_node` and the mesh
order (ranks r and r' share a node iff r // gpus_per_node == r' // gpus_per_node). A ring over
n ranks takes 2(n−1) latency steps for an all-reduce and n−1 for the other collectives.

Overlap: data-parallel reduction (and ZeRO's gathers) can hide behind backward, which is
about 2/3 of the compute; tensor-, context- and expert-parallel collectives sit on the
critical path. The pipeline bubble stretches the compute by 1 / (1 − bubble). This is a model
for comparing layouts, not a simulator: it says which axis dominates, not the exact seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "send": lambda n: 1, "recv": lambda n: 0}


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
    """Peak dense bf16 FLOP/s per GPU."""
    memory: float
    """Device memory, bytes."""
    gpus_per_node: int
    intra: Link
    inter: Link
    mfu: float = 0.45
    """Fraction of peak a well-tuned step reaches (40-55% is typical for large dense models)."""


# NVIDIA H100 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3, NVLink 4 at 900 GB/s bidirectional
# (450 GB/s each way) inside an 8-GPU node, one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s).
H100 = Hardware(
    "H100 SXM (8/node, NVLink + 400G IB)",
    989e12,
    80e9,
    8,
    intra=Link(alpha=3e-6, beta=450e9),
    inter=Link(alpha=8e-6, beta=50e9),
)
# NVIDIA A100 SXM4 80GB: 312 TFLOP/s bf16, NVLink 3 at 600 GB/s (300 each way), 200 Gb/s HDR per GPU.
A100 = Hardware(
    "A100 SXM 80GB (8/node, NVLink + 200G IB)",
    312e12,
    80e9,
    8,
    intra=Link(alpha=3e-6, beta=300e9),
    inter=Link(alpha=8e-6, beta=25e9),
)
HARDWARE = {"h100": H100, "a100": A100}


def spans_nodes(group: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in group}) > 1


def collective_seconds(op: str, wire_bytes: float, n: int, link: Link) -> float:
    """α·steps + bytes/β for one collective of a ring over n ranks sending wire_bytes per rank."""
    if n <= 1:
        return 0.0
    steps = RING_STEPS.get(op, lambda k: k - 1)(n)
    return steps * link.alpha + wire_bytes / link.beta


def compute_flops(params: float, tokens: float, recompute: bool = False) -> float:
    """FLOPs of one training step: 6Ψ per token (2 forward + 4 backward), 8Ψ with full recomputation."""
    return (8.0 if recompute else 6.0) * params * tokens


@dataclass
class StepTime:
    compute: float
    """Seconds of compute per rank, bubble included."""
    comm: dict[str, float]
    """Seconds of communication per mesh dim (as named in the comm rows)."""
    exposed: dict[str, float]
    """What of each dim's communication is not hidden behind compute."""
    total: float
    dominant: str
    """'compute' or the dim whose exposed communication is largest."""
    flops_per_rank: float
    mfu: float
    """Model FLOPs utilisation this step time implies (6Ψ·tokens / (total · peak · world))."""


OVERLAPPABLE = ("dp",)
"""Dims whose traffic (gradient reduction, ZeRO gathers) can hide behind backward."""


def step_time(
    rows: list[dict],
    groups: dict[str, list[int]],
    params: float,
    tokens: float,
    world: int,
    hw: Hardware = H100,
    bubble: float = 0.0,
    recompute: bool = False,
) -> StepTime:
    """Time of one step from one rank's comm rows ({dim, op, calls, wire_bytes}) and, per dim, one
    of its groups (global ranks: decides intra- vs inter-node)."""
    flops = compute_flops(params, tokens, recompute) / world
    compute = flops / (hw.flops * hw.mfu) / (1.0 - bubble)
    comm: dict[str, float] = {}
    for row in rows:
        group = groups[row["dim"]]
        link = hw.inter if spans_nodes(group, hw.gpus_per_node) else hw.intra
        per_call = row["wire_bytes"] / max(row["calls"], 1)
        t = row["calls"] * collective_seconds(row["op"], per_call, len(group), link)
        comm[row["dim"]] = comm.get(row["dim"], 0.0) + t
    backward = compute * 2 / 3
    exposed = {}
    for dim, t in comm.items():
        hideable = any(d in OVERLAPPABLE for d in dim.split("-")) and not any(
            d in ("tp", "cp", "ep") for d in dim.split("-")
        )
        exposed[dim] = max(0.0, t - backward) if hideable else t
    total = compute + sum(exposed.values())
    dominant = max(exposed, key=exposed.get) if exposed and max(exposed.values()) > compute else "compute"
    mfu = compute_flops(params, tokens) / (total * hw.flops * world)
    return StepTime(compute, comm, exposed, total, dominant, flops, mfu)
