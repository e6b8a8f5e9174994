"""Communication per rank: every collective a layout issues in one (steady-state) step, with the
same op names, dims and ring-model wire bytes the comm meter records (DESIGN.md section 4)."""
from __future__ import annotations

from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.engines.mesh import MeshLayout
from labkit.engines.parallel.buckets import plan_buckets

# ring model, B = bytes of the full tensor, n = group size (same table as the engines' meter)
WIRE = {
    "all_reduce": lambda B, n: 2 * (n - 1) / n * B,
    "all_gather": lambda B, n: (n - 1) / n * B,
    "reduce_scatter": lambda B, n: (n - 1) / n * B,
    "all_to_all": lambda B, n: (n - 1) / n * B,
    "broadcast": lambda B, n: (n - 1) / n * B,
    "send": lambda B, n: B,
    "recv": lambda B, n: 0,
}


def torch_ddp_buckets(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """PyTorch DDP's rebuilt buckets (from iteration 2 on, with an explicit bucket_cap_mb):
    gradients in ready order (~ reverse registration), a bucket closes once it reaches the cap."""
    buckets, current, filled = [], [], 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        if filled >= cap_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class Comm:
    """Accumulates predicted ops as rows {rank, dim, op, calls, payload_bytes, wire_bytes}."""

    def __init__(self):
        self.rows: dict[tuple, dict] = {}

    def add(self, rank: int, dim: str, op: str, payload: int, n: int, calls: int = 1) -> None:
        if n <= 1:
            return
        row = self.rows.setdefault((rank, dim, op), {"rank": rank, "dim": dim, "op": op, "calls": 0,
                                                     "payload_bytes": 0, "wire_bytes": 0.0})
        for _ in range(calls):
            row["calls"] += 1
            row["payload_bytes"] += payload
            row["wire_bytes"] += WIRE[op](payload, n)

    def table(self) -> list[dict]:
        return [self.rows[k] for k in sorted(self.rows)]


def comm_rows(comm: Comm, cfg: ParallelConfig, model: ModelConfig, layout: MeshLayout) -> None:
    """Every collective of one steady-state step of `cfg`, per rank. Each strategy adds its own
    ops from its theory module (tensor.py, context.py, experts.py, pipeline.py, sharding.py)."""
    from labkit.theory import tensor

    tensor.comm_rows(comm, cfg, model, layout)
    data_parallel(comm, cfg, model, layout)


def data_parallel(comm: Comm, cfg: ParallelConfig, model: ModelConfig, layout: MeshLayout) -> None:
    """DDP (sharding='none'): each bucket of gradients all-reduced once per step over the dims its
    parameters' gradients are summed over (dp x ep x cp; SP's LayerNorms add tp). As in
    engines/parallel/ddp.py `plan`: parameters grouped by those dims, each group bucketed."""
    from labkit.theory.tensor import rank_params

    params = rank_params(cfg, model)                       # this rank's (name, shape, reduce dims)
    sizes = [prod(s) * 4 for _, s, _ in params]             # fp32 gradients
    cap = int(cfg.bucket_mb * 2**20)
    if cfg.impl == "torch":
        groups = {("dp", "ep", "cp"): list(range(len(params)))}   # PyTorch's DDP: one process group
        buckets = [(dims, [idx[j] for j in b]) for dims, idx in groups.items()
                   for b in torch_ddp_buckets([sizes[i] for i in idx], cap)]
    else:
        groups: dict[tuple, list[int]] = {}
        for i, (_, _, dims) in enumerate(params):
            groups.setdefault(dims, []).append(i)
        buckets = sorted(((dims, [idx[j] for j in b]) for dims, idx in groups.items()
                          for b in plan_buckets([sizes[i] for i in idx], cap)), key=lambda d_b: -d_b[1][0])
    for rank in range(layout.world):
        for dims, b in buckets:
            comm.add(rank, layout.label(*dims), "all_reduce", sum(sizes[i] for i in b), layout.size(*dims))
