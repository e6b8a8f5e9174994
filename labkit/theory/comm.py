"""Communication per rank: every collective a layout issues in one (steady-state) step, with the
same op names, dims and ring-model wire bytes the comm meter records (labkit/plans/wire.py)."""
from __future__ import annotations

from math import prod

from labkit.config import ModelConfig, ParallelConfig
from labkit.plans.buckets import plan_groups, torch_ddp_buckets
from labkit.plans.mesh import MeshLayout
from labkit.plans.wire import WIRE

class Comm:
    """Accumulates predicted ops as rows {rank, dim, op, calls, payload_bytes, wire_bytes}.

    `only`: the ranks to fill (theory modules loop over `comm.ranks(layout)`); the estimate at
    scale fills one representative rank per class and copies its rows to the others."""

    def __init__(self, only: list[int] | None = None):
        self.rows: dict[tuple, dict] = {}
        self.only = only

    def ranks(self, layout) -> list[int] | range:
        return range(layout.world) if self.only is None else self.only

    def add(self, rank: int, dim: str, op: str, payload: int, n: int, calls: int = 1) -> None:
        if n <= 1 or calls <= 0:
            return
        row = self.rows.setdefault((rank, dim, op), {"rank": rank, "dim": dim, "op": op, "calls": 0,
                                                     "payload_bytes": 0, "wire_bytes": 0.0})
        wire = WIRE[op](payload, n)
        if calls > 64:   # at scale (thousands of calls): one multiplication
            row["calls"] += calls
            row["payload_bytes"] += payload * calls
            row["wire_bytes"] += wire * calls
            return
        for _ in range(calls):   # summed call by call, as the meter does, so the floats agree exactly
            row["calls"] += 1
            row["payload_bytes"] += payload
            row["wire_bytes"] += wire

    def per_stage(self, layout, ops_of) -> None:
        """Rows that depend only on a rank's pipeline coordinate: `ops_of(pp_rank)` gives
        (dim, op, payload bytes, group size, calls) tuples, summed once per coordinate and added
        to each of its ranks (the splits are even, so those ranks issue the same collectives)."""
        done: dict[int, list[dict]] = {}
        for rank in self.ranks(layout):
            pp_rank = layout.coords(rank)["pp"]
            if pp_rank not in done:
                stage = Comm()
                for dim, op, payload, n, calls in ops_of(pp_rank):
                    stage.add(0, dim, op, payload, n, calls)
                done[pp_rank] = stage.table()
            self.add_rows(rank, done[pp_rank])

    def add_rows(self, rank: int, rows: list[dict]) -> None:
        """Add rows summed elsewhere (the same for every rank at one pipeline coordinate) to `rank`."""
        for r in rows:
            row = self.rows.setdefault((rank, r["dim"], r["op"]), {"rank": rank, "dim": r["dim"], "op": r["op"],
                                                                   "calls": 0, "payload_bytes": 0, "wire_bytes": 0.0})
            row["calls"] += r["calls"]
            row["payload_bytes"] += r["payload_bytes"]
            row["wire_bytes"] += r["wire_bytes"]

    def table(self) -> list[dict]:
        return [self.rows[k] for k in sorted(self.rows)]


def comm_rows(comm: Comm, cfg: ParallelConfig, model: ModelConfig, layout: MeshLayout) -> None:
    """Every collective of one steady-state step of `cfg`, per rank. Each strategy adds its own
    ops from its theory module (tensor.py, context.py, experts.py, pipeline.py, sharding.py)."""
    from labkit.theory import context, experts, pipeline, tensor

    tensor.comm_rows(comm, cfg, model, layout)
    context.comm_rows(comm, cfg, model, layout)
    experts.comm_rows(comm, cfg, model, layout)
    pipeline.p2p_rows(comm, cfg, model, layout)
    if cfg.sharding == "none":
        data_parallel(comm, cfg, model, layout)
        grad_norm(comm, cfg, layout)
    else:
        from labkit.theory import sharding

        sharding.comm_rows(comm, cfg, model, layout)   # ZeRO / FSDP, its own norm included


def data_parallel(comm: Comm, cfg: ParallelConfig, model: ModelConfig, layout: MeshLayout) -> None:
    """DDP (sharding='none'): each bucket of gradients all-reduced once per step over the dims its
    parameters are reduced over (dp x ep x cp; experts under ep: dp x cp; SP's LayerNorms add tp),
    bucketed per group and per pipeline chunk (the whole model when pp == 1), as
    engines/parallel/ddp.py `plan` does. Buckets are cut by gradient bytes in the compute dtype
    and reduced in fp32 (bf16 gradients go through an fp32 copy: engines/precision.py)."""
    from labkit.theory.params import chunk_params

    elem = 2 if cfg.precision == "bf16" else 4
    cap = int(cfg.bucket_mb * 2**20)

    def buckets(pp_rank: int):
        for chunk in chunk_params(cfg, model, pp_rank):
            numels = [prod(s) for _, s, _ in chunk]
            sizes = [k * elem for k in numels]
            if cfg.impl == "torch":   # PyTorch's DDP: one process group
                groups = [(("dp", "ep", "cp"), b) for b in torch_ddp_buckets(sizes, cap)]
            else:
                groups = plan_groups(sizes, [dims for _, _, dims in chunk], cap)
            for dims, b in groups:
                yield layout.label(*dims), "all_reduce", 4 * sum(numels[i] for i in b), layout.size(*dims), 1

    comm.per_stage(layout, buckets)


def grad_norm(comm: Comm, cfg: ParallelConfig, layout: MeshLayout) -> None:
    """The global gradient norm (engines/parallel/common.py norm_plan): one fp32 scalar
    all-reduced over the dims that split the parameters (tp, pp, ep), in the optimizer phase."""
    split = tuple(d for d in ("tp", "pp", "ep") if layout.size(d) > 1)
    if not split:
        return
    for rank in comm.ranks(layout):
        comm.add(rank, layout.label(*split), "all_reduce", 4, layout.size(*split))
