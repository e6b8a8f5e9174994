"""Data-parallel traffic in time, and what of it hides behind compute: the ring model's seconds of
DDP's all-reduce, ZeRO's reduce-scatter and all-gather, FSDP's per-block gathers (Rajbhandari et
al., SC 2020, section 7, for the volumes; Zhao et al., VLDB 2023, section 3.3, for FSDP's
prefetching). Each is returned as (dim, total seconds, seconds hidden) for theory/planner/timing.py.

  DDP          the gradients' all-reduce behind the last microbatch's backward
  ZeRO-1       the reduce-scatter behind the last backward, the parameters' gather behind the next
               forward (Megatron-LM's --overlap-param-gather)
  ZeRO-2       a reduce-scatter behind every microbatch's backward, the gather behind the forward
  ZeRO-3/FSDP  per microbatch, block by block: the next block's gather behind this one's forward,
               (gather again and) reduce-scatter behind its backward; the root unit (embedding,
               head) exposed. With pp > 1 (torchtitan): parameters gathered once per step and
               gradients reduce-scattered once, after the last microbatch
  HSDP         each of the above inside the shard group (dp_replicate > 1), and every reduce-scattered
               shard all-reduced across the replicas on the dp_replicate dim's link, behind what the
               scatter leaves of its compute (torchtitan's dp_replicate x dp_shard)
Gradients are reduced in fp32, parameters gathered in the compute dtype (fp8 under fp8 training).
"""

from __future__ import annotations

from functools import lru_cache

from labkit.config import ModelConfig, ParallelConfig
from labkit.layout.mesh import DATA_DIMS, shard_dims
from labkit.layout.precision import GATHER, REDUCE
from labkit.layout.wire import WIRE
from labkit.theory.planner.hardware import Hardware, Link
from labkit.theory.planner.stages import Stage, rank_params, stage_params

# a ring all-reduce is a reduce-scatter then an all-gather, 2(n-1) steps; a send one; a receive
# none (its sender's count holds it); every other collective n - 1 steps of its ring
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "send": lambda n: 1, "recv": lambda n: 0}


def collective_seconds(op: str, wire_bytes: float, n: int, link: Link) -> float:
    """α·steps + bytes/β for one collective of a ring over n ranks sending wire_bytes per rank."""
    if n <= 1:
        return 0.0
    steps = RING_STEPS.get(op, lambda k: k - 1)(n)
    return steps * link.alpha + wire_bytes / link.beta


def ring(op: str, payload: float, n: int, link: Link) -> float:
    """Seconds of one collective of `payload` bytes (the whole tensor) over n ranks."""
    return collective_seconds(op, WIRE[op](payload, n), n, link) if n > 1 else 0.0


def spans_nodes(group: list[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in group}) > 1


def link_of(cfg: ParallelConfig, dims: tuple[str, ...], hw: Hardware) -> Link:
    """The link a group of `dims` runs on. In the mesh order (innermost first) a dim's ranks are
    `stride` apart, so its group spans stride · size consecutive ranks: inside a node, NVLink;
    across nodes, the NICs of the group's ranks on each node, k of them, since NCCL lays one ring
    (channel) over each NIC (so k · the NIC's β, up to NVLink's; Jeaugey, "Massively Scale Your
    Deep Learning Training with NCCL 2.4", NVIDIA 2019: rings per NIC on DGX nodes)."""
    sizes = tuple(getattr(cfg, d) for d in ("tp", "cp", "ep", "dp", "pp"))
    return _link(cfg.order, sizes, dims, hw, cfg.dp_replicate)


def run_link(cfg: ParallelConfig, dim: str, k: int, hw: Hardware) -> Link:
    """The link of a run of k consecutive coordinates along `dim` (hierarchical CP's all-to-all):
    link_of as if `dim` had k ranks, the dims outside it unmoved."""
    return _link(
        cfg.order, tuple(k if d == dim else getattr(cfg, d) for d in ("tp", "cp", "ep", "dp", "pp")), (dim,), hw
    )


@lru_cache(maxsize=4096)
def _link(order_text: str, sizes: tuple[int, ...], dims: tuple[str, ...], hw: Hardware, replicas: int = 1) -> Link:
    """link_of, memoised on the degrees (the search asks it for thousands of layouts). HSDP
    (`replicas` > 1): dp's place holds dp_shard then dp_replicate (layout/mesh.py SUB_DIMS), and a
    group of dp spans both."""
    size = dict(zip(("tp", "cp", "ep", "dp", "pp"), sizes))
    order = order_text.split("-")
    if replicas > 1:
        size |= {"dp_shard": size["dp"] // replicas, "dp_replicate": replicas}
        at = order.index("dp")
        order[at : at + 1] = ["dp_shard", "dp_replicate"]
        dims = tuple(x for d in dims for x in (("dp_shard", "dp_replicate") if d == "dp" else (d,)))
    # extent: the consecutive ranks the group spans; inner: the smallest stride of a dim it splits,
    # which sets how many of its ranks share a node
    extent, inner = 1, hw.gpus_per_node
    for d in dims:
        stride = 1
        for other in order[: order.index(d)]:
            stride *= size[other]
        extent = max(extent, stride * size[d])
        if size[d] > 1:
            inner = min(inner, stride)
    # a node's consecutive ranks share NVLink
    if extent <= hw.gpus_per_node:
        return hw.intra
    # k ranks of the group on each node, each on its own NIC: k rings side by side, never past NVLink
    k = max(1, hw.gpus_per_node // inner)
    return Link(hw.inter.alpha, min(hw.intra.beta, k * hw.inter.beta))


class DataParallel:
    """The data-parallel traffic of one layout on one pipeline rank."""

    def __init__(self, cfg: ParallelConfig, model: ModelConfig, hw: Hardware):
        self.cfg, self.model = cfg, model
        order = cfg.order.split("-")
        # the data dims of size > 1 in mesh order: the group the gradients are reduced over, and its label
        data = tuple(d for d in order if d in DATA_DIMS and getattr(cfg, d) > 1)
        # HSDP: buffers sharded over the shard group (dp_shard for dp), the reduced shards all-reduced
        # over dp_replicate on its own link (usually across nodes); R = 1: the flat dp dim as before
        self.replicas = cfg.dp_replicate
        hybrid = self.replicas > 1
        dp = cfg.dp // self.replicas
        shard = shard_dims(data, hybrid)
        self.dim = "-".join(shard) or "dp"
        self.n = dp * cfg.ep * cfg.cp  # dense weights: reduced (and sharded) over dp x ep x cp
        self.n_expert = dp * cfg.cp if cfg.ep > 1 else self.n
        self.link = link_of(cfg, shard or ("dp",), hw)
        self.expert_link = link_of(cfg, shard_dims(("dp", "cp"), hybrid), hw)
        self.replica_link = link_of(cfg, ("dp_replicate",), hw) if hybrid else None
        self.gather = GATHER[cfg.precision]
        self.sharded = cfg.sharded.params
        # ZeRO-3 reshards always; FSDP only without a pipeline (torchtitan keeps a stage gathered)
        self.reshard = cfg.sharded.per_module_units or (cfg.reshard_after_forward and cfg.pp == 1)

    def _both(self, op: str, per_elem: int, dense: float, expert: float) -> float:
        return ring(op, per_elem * dense, self.n, self.link) + ring(
            op, per_elem * expert, self.n_expert, self.expert_link
        )

    def _across(self, dense: float, expert: float) -> float:
        """HSDP: seconds of the replicas' all-reduce of the reduce-scattered fp32 shards of `dense`
        and `expert` parameters (engines/parallel/shards.py all_reduce_replicas); 0 without HSDP."""
        if self.replicas == 1:
            return 0.0
        return ring("all_reduce", REDUCE * dense / self.n, self.replicas, self.replica_link) + ring(
            "all_reduce", REDUCE * expert / self.n_expert, self.replicas, self.replica_link
        )

    def _scatter(self, rs: float, across: float, window: float) -> list[tuple[str, float, float]]:
        """A reduce-scatter and, under HSDP, the all-reduce of its shard across the replicas, which
        follows it behind the same compute: the all-reduce hides in what the scatter leaves of
        `window`, so the two expose max(0, rs + across - window) together."""
        return [(self.dim, rs, window)] + [("dp_replicate", across, max(0.0, window - rs))] * (across > 0)

    def per_microbatch(self, st: Stage, block) -> list[tuple[str, float, float]]:
        """(dim, seconds, hidden) of the traffic each microbatch repeats."""
        cfg = self.cfg
        # ZeRO-2: a reduce-scatter after every microbatch's backward, behind it
        if cfg.sharded.stage == 2:
            dense, expert = stage_params(self.model, cfg, st)
            total = self._both("reduce_scatter", REDUCE, dense, expert)
            return self._scatter(total, self._across(dense, expert), st.layers * block.backward)
        # DDP and ZeRO-1 reduce once a step, and so does FSDP under a pipeline (per_step)
        if not self.sharded or cfg.pp > 1:
            return []
        rp = rank_params(self.model, cfg.tp, cfg.ep)
        ag = self._both("all_gather", self.gather, rp.dense, rp.expert)
        rs = self._both("reduce_scatter", REDUCE, rp.dense, rp.expert)
        root = rp.embed * st.embed + rp.head * st.head
        L = st.layers
        # behind a block's backward: its gather again (when it was resharded) and its reduce-scatter
        back = (ag if self.reshard else 0.0) + rs
        again = block.recompute(cfg.recomputation)
        hidden = max(0, L - 1) * min(back, block.backward + again)
        # HSDP: each block's shard all-reduced across the replicas in what its backward leaves
        left = max(0, L - 1) * max(0.0, block.backward + again - back)
        out = [
            (self.dim, L * ag, max(0, L - 1) * min(ag, block.forward)),  # the first block's gather is exposed
            (self.dim, L * back, hidden),
            # the root unit is gathered around the whole forward (and backward, resharded): nothing to hide behind
            (self.dim, self._both("all_gather", self.gather, root, 0) * (1 + self.reshard), 0.0),
            (self.dim, self._both("reduce_scatter", REDUCE, root, 0), 0.0),
        ]
        if self.replicas > 1:  # HSDP: the blocks' shards in what their backward leaves, the root's exposed
            out += [
                ("dp_replicate", L * self._across(rp.dense, rp.expert), left),
                ("dp_replicate", self._across(root, 0), 0.0),
            ]
        return out

    def per_step(self, st: Stage, block, m: int) -> list[tuple[str, float, float]]:
        """(dim, seconds, hidden) of the traffic once per step."""
        cfg = self.cfg
        # one data rank: nothing to reduce
        if self.n == 1:
            return []
        dense, expert = stage_params(self.model, cfg, st)
        backward = st.layers * (block.backward + block.recompute(cfg.recomputation))
        forward = st.layers * block.forward
        if not cfg.sharded.optimizer:
            return [(self.dim, self._both("all_reduce", REDUCE, dense, expert), backward)]
        gather = self._both("all_gather", self.gather, dense, expert)
        if not cfg.sharded.params:  # ZeRO-1 / 2
            # ZeRO-2 reduced per microbatch already (per_microbatch): its gather is what is left
            scatter = self._both("reduce_scatter", REDUCE, dense, expert) if not cfg.sharded.grads else 0.0
            across = self._across(dense, expert) if not cfg.sharded.grads else 0.0
            return [*self._scatter(scatter, across, backward), (self.dim, gather, forward)]
        # FSDP without a pipeline moves everything per microbatch (per_microbatch)
        if cfg.pp == 1:
            return []
        rs = self._both("reduce_scatter", REDUCE, dense, expert)
        L = max(st.layers, 1)  # once per step, block by block behind the first forward and last backward
        across = self._across(dense, expert)
        return [(self.dim, gather, forward * (L - 1) / L), *self._scatter(rs, across, backward * (L - 1) / L)]

    def copy_bytes(self, st: Stage, per_step: bool) -> float:
        """Bytes FSDP2 copies around its collectives on the compute device: per all-gather the
        shard cast into the send buffer ((4 + e)/N per parameter) and the gathered buffer split
        into the parameters (2e); per reduce-scatter the gradients packed in fp32 (e + 4) and the
        shard added into the sharded gradient (12/N). Per microbatch (per step under pp)."""
        if not self.sharded or (cfg := self.cfg).pp > 1 and not per_step or cfg.pp == 1 and per_step:
            return 0.0
        dense, expert = stage_params(self.model, cfg, st)
        e = self.gather
        gathers = 1 + (self.reshard and cfg.pp == 1)
        per_param = gathers * (2 * e + (4 + e) / self.n) + (e + 4) + 12 / self.n
        return per_param * (dense + expert)

    def optimizer_elements(self, st: Stage) -> float:
        """Parameter elements this rank's optimizer updates (its shard under ZeRO / FSDP)."""
        dense, expert = stage_params(self.model, self.cfg, st)
        if not self.cfg.sharded.optimizer:
            return dense + expert
        # dense shards over dp·ep·cp, experts over dp·cp
        return dense / self.n + expert / self.n_expert
