"""Hybrid sharded data parallelism (HSDP): dp=4 as dp_replicate=2 x dp_shard=2 on the
4-engine cluster, ours (ZeRO-1/2/3, FSDP) and PyTorch's (FSDP2 on a 2-D DeviceMesh), against the
one-process reference, with measured bytes and memory equal to the theory's; the mesh's groups
and the config's refusals on paper.

The shard group is the inner half of dp (ranks 0, 1 and 2, 3 with 'tp-cp-ep-dp-pp'), the replicas
the outer (0, 2 and 1, 3): the reduce-scatter and all-gather run inside (row 'dp_shard'), only the
reduced shard is all-reduced across (row 'dp_replicate').
"""

from __future__ import annotations

import pytest
from conftest import TINY
from test_sharding import check_against_theory

from labkit import ConfigError, ParallelConfig, theory, validate
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import assert_matches

GQA = TINY.replace(arch="llama", kv_heads=2)
"""Grouped-query attention: 4 query heads read 2 KV heads (SwiGLU, RMSNorm, RoPE, untied)."""

CASES = [
    ("zero3", "lab", "fp32", TINY, 1),
    ("fsdp", "lab", "fp32", GQA, 1),
    ("fsdp", "lab", "bf16", TINY, 1),
    ("zero1", "lab", "fp32", GQA, 1),
    ("zero2", "lab", "bf16", TINY, 1),
    ("fsdp", "torch", "fp32", TINY, 1),
    ("fsdp", "torch", "bf16", GQA, 1),
    # two microbatches: ZeRO-1 reduces (and all-reduces its shards) once, ZeRO-2 and FSDP per microbatch
    ("zero1", "lab", "fp32", TINY, 2),
    ("fsdp", "lab", "fp32", GQA, 2),
    # GPT-2's family: biases and the tied embedding, one parameter in two places, sharded once
    ("fsdp", "lab", "fp32", TINY.replace(arch="gpt2"), 1),
    ("fsdp", "torch", "fp32", TINY.replace(arch="gpt2"), 1),
]
"""(sharding, impl, precision, model, microbatches) of dp=4 as 2 x 2."""


def hsdp(sharding: str, impl: str = "lab", precision: str = "fp32", **kw) -> ParallelConfig:
    return ParallelConfig(dp=4, dp_replicate=2, sharding=sharding, impl=impl, precision=precision, **kw)


@pytest.mark.parametrize("sharding, impl, precision, model, microbatches", CASES)
def test_hsdp_trains_like_one_process(lab, ref_cache, sharding, impl, precision, model, microbatches):
    cfg = hsdp(sharding, impl, precision, microbatches=microbatches)
    res = lab.run(cfg, model=model, steps=3, return_params=True)
    assert_matches(res, ref_cache(model, steps=3, global_batch=cfg.global_batch))
    check_against_theory(res, cfg, model)
    rows = {(r["dim"], r["op"]) for r in res.comm_table()}
    # the two halves apart: gathers and scatters inside the shard group, one all-reduce across
    assert {("dp_shard", "reduce_scatter"), ("dp_shard", "all_gather"), ("dp_replicate", "all_reduce")} <= rows
    assert not {d for d, _ in rows} & {"dp"}, rows
    assert {(d, op) for d, op in rows if d == "dp_replicate"} == {("dp_replicate", "all_reduce")}


def test_hsdp_sends_half_the_shard_across(lab):
    """Per rank and step, what crosses the replicate dim is the reduce-scattered shard (fp32),
    all-reduced over 2 ranks: Ψ/2 elements of TINY (its buffers need no padding over 2), on the
    ring model 2(R-1)/R = 1 times their bytes on the wire; the all-gathers never cross it. FSDP
    over the flat dp=4 has no such row: its every collective spans all four ranks."""
    cfg = hsdp("zero3")
    res = lab.run(cfg, model=TINY, steps=2)
    psi = theory.num_params(TINY)
    assert sum(p.shard for p in theory.exact.sharding.flat_buffers(cfg, TINY)) * 2 == psi
    across = [r for r in res.comm_table() if r["dim"] == "dp_replicate"]
    assert len(across) == 4 and {r["op"] for r in across} == {"all_reduce"}
    for r in across:
        assert (r["payload_bytes"], r["wire_bytes"]) == (4 * psi // 2, 4 * psi // 2), r
    flat = theory.estimate(ParallelConfig(dp=4, sharding="zero3"), TINY).comm_table()
    assert {r["dim"] for r in flat} == {"dp"}


# -- on paper ----------------------------------------------------------------------------------


def test_the_mesh_places_shard_inside_replicate_outside():
    lay = MeshLayout.of(ParallelConfig(dp=4, tp=2, dp_replicate=2, sharding="fsdp"))
    assert lay.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dp itself keeps its meaning
    assert lay.label("dp_shard", "ep", "cp") == "dp_shard" and lay.size("dp_shard", "dp_replicate") == 4
    outer = MeshLayout.of(ParallelConfig(dp=4, tp=2, dp_replicate=2, order="dp-tp-cp-ep-pp", sharding="fsdp"))
    assert outer.groups("dp_shard") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert outer.groups("tp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    plain = MeshLayout.of(ParallelConfig(dp=4, tp=2))
    assert plain.groups("dp_shard") == plain.groups("dp") and plain.groups("dp_replicate") == [[r] for r in range(8)]


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(dp=4, dp_replicate=3, sharding="fsdp"), "dp_replicate=3 does not divide dp=4"),
        (dict(dp=4, dp_replicate=2), "with sharding='none'"),
        (dict(dp=4, dp_replicate=4, sharding="zero3"), "leaves shard groups of one rank"),
        (dict(dp=2, tp=2, dp_replicate=2, sharding="fsdp"), "leaves shard groups of one rank"),
        (dict(dp=4, tp=2, dp_replicate=2, sharding="fsdp", impl="torch"), "3-D mesh) it is not built"),
        (dict(dp=4, dp_replicate=0, sharding="fsdp"), "dp_replicate=0 must be a positive integer"),
    ],
)
def test_what_hsdp_refuses(kw, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        validate(ParallelConfig(**kw), TINY)


def test_composed_hsdp_rows_on_paper():
    """HSDP x tp x pp on 16 ranks (beyond the 4 engines): every rank's shard rows over dp_shard, its
    replicate all-reduce over dp_replicate of the shard's fp32 bytes, its norm over the shard group's
    dims only; and the same layout without HSDP sends nothing across dp_replicate."""
    cfg = ParallelConfig(dp=4, tp=2, pp=2, dp_replicate=2, sharding="fsdp", microbatches=2)
    est = theory.estimate(cfg, TINY)
    dims = {r["dim"] for r in est.comm_table()}
    assert {"dp_shard", "dp_replicate", "tp", "pp"} <= dims and "dp" not in dims
    for pp_rank in range(2):
        bufs = theory.exact.sharding.flat_buffers(cfg, TINY, pp_rank=pp_rank)
        assert all(b.n == 2 and b.dims == ("dp_shard", "ep", "cp") for b in bufs)
    norm = [r for r in est.comm_table() if r["op"] == "all_reduce" and r["payload_bytes"] == 4]
    assert norm and {r["dim"] for r in norm} == {"tp-dp_shard-pp"}


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=4, tp=2, pp=2, dp_replicate=2, sharding="fsdp", microbatches=2, global_batch=8),
        ParallelConfig(dp=4, cp=2, dp_replicate=2, sharding="zero3", precision="bf16", global_batch=8),
        ParallelConfig(dp=4, tp=2, dp_replicate=2, sharding="zero2", sequence_parallel=True, global_batch=8),
    ],
    ids=["fsdp-dp2x2-tp2-pp2", "zero3-dp2x2-cp2-bf16", "zero2-dp2x2-tp2sp"],
)
def test_composed_hsdp_dry_runs_as_predicted(cfg):
    """HSDP x tp x pp, x cp, x tp+SP on 8 or 16 ranks (beyond the 4 engines), the last rank run by
    the engines' own code on a fake process group (labkit.dry_run): model states, activations and
    every comm row equal the theory, the shard rows over the shard group with cp or tp where a
    buffer's reduce dims hold them ('cp-dp_shard', SP LayerNorms' 'tp-dp_shard'), the replicas'
    all-reduce over 'dp_replicate'."""
    from labkit import dry_run

    d = dry_run(cfg, GQA.replace(layers=4), rank=cfg.world - 1)
    assert d.differences(activation_tolerance=0.10) == []
    dims = {r["dim"] for r in d.comm_table()}
    assert "dp_replicate" in dims and "dp" not in dims and any("dp_shard" in x for x in dims)


def _across_nodes(cfg: ParallelConfig, model, gpus_per_node: int = 8) -> float:
    """Bytes rank 0 sends across nodes per step, by the exact theory's rows on the ring model: a
    group of n ranks laid over k nodes (consecutive ranks per node) crosses a node boundary at k
    of its n ring hops, so k/n of each rank's wire bytes leave its node; a group in one node, none."""
    lay, out = MeshLayout.of(cfg), 0.0
    for r in theory.estimate(cfg, model).comm_table():
        if r["rank"] == 0:
            group = lay.group_of(0, *r["dim"].split("-"))
            nodes = {g // gpus_per_node for g in group}
            out += r["wire_bytes"] * (len(nodes) / len(group) if len(nodes) > 1 else 0.0)
    return out


def test_the_planner_prices_the_shard_on_nvlink_and_the_replicas_across_nodes():
    """Llama 3.1 70B on 64 nodes of 8 H100s, FSDP in bf16: HSDP with a shard group per node
    (dp_shard=8, dp_replicate=64) against flat FSDP over the 512 GPUs. The planner puts the shard
    traffic on NVLink and the replicas' all-reduce on one NIC per rank (each replicate group has
    one rank per node), its seconds bounded below by the exact theory's bytes over that link; and
    HSDP sends fewer bytes across nodes per step than flat FSDP (on the ring model only slightly:
    its fp32 all-reduce of a 1/8 shard against 1/8 of the flat ring's bf16 gathers and fp32 scatter)."""
    from labkit.theory.planner.hardware import H100
    from labkit.theory.planner.overlap import DataParallel
    from labkit.theory.planner.timing import step_time
    from labkit.theory.presets import LLAMA31_70B as M

    cfg = ParallelConfig(
        dp=512, dp_replicate=64, sharding="fsdp", precision="bf16", global_batch=512, checkpoint_activations=True
    )
    flat = cfg.replace(dp_replicate=1)
    dp = DataParallel(cfg, M, H100)
    assert (dp.dim, dp.n, dp.link) == ("dp_shard", 8, H100.intra)
    assert (dp.replica_link.alpha, dp.replica_link.beta) == (H100.inter.alpha, H100.inter.beta)
    assert DataParallel(flat, M, H100).link.alpha == H100.inter.alpha  # the flat ring crosses nodes
    t = step_time(cfg, M, H100)
    assert set(t.comm) == {"dp_shard", "dp_replicate"}
    wire = {}
    for r in theory.estimate(cfg, M).comm_table():
        if r["rank"] == 0:
            wire[r["dim"]] = wire.get(r["dim"], 0.0) + r["wire_bytes"]
    # priced on its link: no faster than the bytes at its bandwidth, within the ring's latencies of it
    for dim, link in (("dp_replicate", H100.inter), ("dp_shard", H100.intra)):
        assert wire[dim] / link.beta <= t.comm[dim] <= 1.25 * wire[dim] / link.beta, (dim, t.comm[dim])
    hsdp_across, flat_across = _across_nodes(cfg, M), _across_nodes(flat, M)
    assert 0 < hsdp_across < flat_across, (hsdp_across, flat_across)


def test_the_controls_offer_hsdp_where_it_fits():
    """The dashboard's dp_replicate slider offers only what validation lets through: nothing but 1
    without a sharding, the divisors of dp that leave shard groups of 2 or more with one."""
    from labkit.widgets.controls import offered

    assert offered("dp_replicate", ParallelConfig(dp=4), TINY, 4) == [1]
    assert offered("dp_replicate", ParallelConfig(dp=4, sharding="fsdp"), TINY, 4) == [1, 2]
    assert offered("dp_replicate", ParallelConfig(dp=8, sharding="zero3"), TINY, 8) == [1, 2, 4]


def test_the_mesh_view_draws_the_shard_and_replicate_dims():
    from labkit.widgets.meshview import MeshView

    view = MeshView(ParallelConfig(dp=4, tp=2, dp_replicate=2, sharding="fsdp"), dim="dp_replicate", ranks_per_host=4)
    assert view.groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "4 dp_replicate group(s) of 2; 4 span hosts" in view.text.value
    view.controls["dim"].value = "dp_shard"
    assert view.groups == [[0, 2], [1, 3], [4, 6], [5, 7]] and "0 span hosts" in view.text.value
    view.controls["dp_replicate"].value = 3  # not a divisor of dp: said, and the last figure kept
    assert "dp_replicate=3 must divide dp=4" in view.text.value
