"""What each mesh dim sends per step, and over which link: NVLink inside a node, or the network
between nodes (the question HSDP and the cp kinds raise: what crosses the slow link).

The bytes are the exact theory's (theory.estimate's comm rows: ring-model wire bytes a rank sends
per step, DERIVATIONS.md "The ring model"), for the rank that sends the most; of them, the part
that crosses nodes (`crossing`: a ring's m of n hops, an all-to-all's share of far ranks); the
rest stays on NVLink. The link speed is the planner's
(overlap.link_of). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from labkit.config import ModelConfig, ParallelConfig
from labkit.config.table import Rows
from labkit.layout.mesh import MeshLayout
from labkit.theory.exact.per_rank import rank_comm
from labkit.theory.planner.hardware import Hardware, hardware_of
from labkit.theory.planner.overlap import link_of, run_link

NVLINK, NETWORK = "NVLink", "network"


def _dims(name: str) -> tuple[str, ...]:
    """A comm row's dim name ('tp', 'cp-dp', 'tp-dp_shard', 'dp_replicate') as the mesh dims it spans."""
    return tuple(name.split("-"))


def link_name(cfg: ParallelConfig, name: str, hw: Hardware) -> str:
    """NVLINK or NETWORK: where a group of the comm dim `name` runs under `cfg` on `hw`."""
    return NVLINK if link_of(cfg, _dims(name), hw) == hw.intra else NETWORK


def crossing(op: str, group: list[int], rank: int, per_node: int) -> float:
    """The fraction of a collective's wire bytes that leave the node: an all-to-all sends an equal
    part to each other rank, so the share of them on other nodes; a ring (all-reduce, all-gather,
    reduce-scatter, and the point-to-point hops of a ring or a pipeline) crosses at m of its n hops
    when its n ranks sit on m nodes, each node's ranks neighbours in the ring (as NCCL orders them)."""
    nodes = {r // per_node for r in group}
    if len(nodes) == 1:
        return 0.0
    if op == "all_to_all":
        return sum(r // per_node != rank // per_node for r in group) / (len(group) - 1)
    return len(nodes) / len(group)


def _speed(cfg: ParallelConfig, name: str, hw: Hardware) -> float:
    """The bandwidth per GPU the planner times a reported dim on (overlap.link_of; a hierarchical
    all-to-all's run: overlap.run_link)."""
    if name == "cp all-to-all":
        return run_link(cfg, "cp", cfg.cp_a2a, hw).beta
    return link_of(cfg, _dims(name.split()[0]), hw).beta


def _level(cfg: ParallelConfig, layout: MeshLayout, rank: int, row: dict) -> tuple[str, list[int]]:
    """(the name a row is reported under, the group it runs in). Hierarchical CP's rows, all 'cp' to
    the meter, run in two groups: its all-to-alls in a run of cp_a2a ranks, its ring's hops across
    the runs (layout/mesh.py runs and strides)."""
    if row["dim"] == "cp" and cfg.context.hierarchical and row["op"] != "all_reduce":
        a = cfg.cp_a2a
        if row["op"] == "all_to_all":
            return "cp all-to-all", next(g for g in layout.runs("cp", a) if rank in g)
        return "cp ring", next(g for g in layout.strides("cp", a) if rank in g)
    return row["dim"], layout.group_of(rank, *_dims(row["dim"]))


def link_traffic(cfg: ParallelConfig, model: ModelConfig, hardware: str | Hardware = "h100") -> Rows:
    """Per comm dim of the rank that sends the most per step: its wire bytes, how many of them stay on
    NVLink and how many cross nodes, the link the planner times the dim on and its bandwidth per GPU
    (NVLink's, or k NICs where k of the group's ranks share a node). The last row sums them."""
    hw = hardware_of(hardware)
    layout = MeshLayout.of(cfg)
    # the comm rows depend on the pipeline stage alone: one rank per stage, as theory.estimate walks them
    stage_ranks = {layout.coords(r)["pp"]: r for r in range(layout.world - 1, -1, -1)}
    rows_of = rank_comm(cfg, model, layout, stage_ranks.values())
    sent = {r: sum(x["wire_bytes"] for x in rows) for r, rows in rows_of.items()}
    rank = max(sent, key=sent.get)
    per_dim: dict[str, list[float]] = {}  # name -> [wire bytes, of which across nodes]
    groups: dict[str, list[int]] = {}
    for r in rows_of[rank]:
        name, group = _level(cfg, layout, rank, r)
        acc = per_dim.setdefault(name, [0.0, 0.0])
        acc[0] += r["wire_bytes"]
        acc[1] += r["wire_bytes"] * crossing(r["op"], group, rank, hw.gpus_per_node)
        groups[name] = group
    out, total = [], {NVLINK: 0.0, NETWORK: 0.0}
    for name, (wire, across) in sorted(per_dim.items(), key=lambda kv: -kv[1][0]):
        nodes = len({r // hw.gpus_per_node for r in groups[name]})
        total[NETWORK] += across
        total[NVLINK] += wire - across
        out.append(
            {
                "rank": rank,
                "dim": name,
                "GB sent": wire / 1e9,
                "GB over NVLink": (wire - across) / 1e9,
                "GB across nodes": across / 1e9,
                "runs on": NVLINK if nodes == 1 else NETWORK,
                "GB/s per GPU": _speed(cfg, name, hw) / 1e9,
            }
        )
    out.append(
        {
            "rank": rank,
            "dim": "total",
            "GB sent": (total[NVLINK] + total[NETWORK]) / 1e9,
            "GB over NVLink": total[NVLINK] / 1e9,
            "GB across nodes": total[NETWORK] / 1e9,
        }
    )
    return Rows(out)
