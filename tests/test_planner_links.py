"""What each mesh dim sends over NVLink and across nodes (labkit/theory/planner/links.py), for the
layouts at scale: HSDP against flat FSDP, hierarchical CP against Ulysses, on 64 nodes
of 8 H100s. Torch-free and fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

from labkit import ParallelConfig
from labkit.theory.planner.hardware import hardware_of
from labkit.theory.planner.links import NETWORK, NVLINK, link_name, link_traffic
from labkit.theory.presets import PRESETS

LLAMA_70B = PRESETS["llama3.1-70b"]
FSDP = ParallelConfig(dp=512, sharding="fsdp", global_batch=512, precision="bf16", checkpoint_activations=True)


def _by_dim(rows) -> dict:
    return {r["dim"]: r for r in rows}


def test_hsdp_sends_its_shard_traffic_on_nvlink_and_only_the_replicas_across():
    hsdp = _by_dim(link_traffic(FSDP.replace(dp_replicate=64), LLAMA_70B))
    flat = _by_dim(link_traffic(FSDP, LLAMA_70B))
    # the shard group is one node's 8 GPUs: its all-gathers and reduce-scatters never leave it
    assert hsdp["dp_shard"]["GB across nodes"] == 0 and hsdp["dp_shard"]["runs on"] == NVLINK
    # the replicas are one GPU per node: all of their all-reduce crosses
    assert hsdp["dp_replicate"]["GB over NVLink"] == 0 and hsdp["dp_replicate"]["runs on"] == NETWORK
    # less across nodes than flat FSDP, whose ring over 512 ranks crosses nodes at 64 of its 512 hops
    assert hsdp["total"]["GB across nodes"] < flat["total"]["GB across nodes"]
    assert flat["dp"]["GB across nodes"] == pytest.approx(flat["dp"]["GB sent"] * 64 / 512)
    # the bytes are the exact theory's, split: nothing lost or added
    for rows in (hsdp, flat):
        total = rows["total"]
        assert total["GB over NVLink"] + total["GB across nodes"] == pytest.approx(total["GB sent"])


def test_hierarchical_cp_keeps_its_all_to_all_in_the_node():
    """cp=16 over two nodes at 128k tokens: Ulysses' all-to-all sends 8 of its 15 parts to the other
    node; hierarchical's runs of 8 keep theirs in one, and only its ring's hops cross."""
    cfg = ParallelConfig(cp=16, dp=32, global_batch=32, precision="bf16", sharding="fsdp", checkpoint_activations=True)
    model = LLAMA_70B.replace(seq=131072)
    ulysses = _by_dim(link_traffic(cfg.replace(cp_kind="ulysses"), model))
    hier = _by_dim(link_traffic(cfg.replace(cp_kind="hierarchical", cp_a2a=8), model))
    assert ulysses["cp"]["GB across nodes"] == pytest.approx(ulysses["cp"]["GB sent"] * 8 / 15)
    assert hier["cp all-to-all"]["GB across nodes"] == 0 and hier["cp all-to-all"]["runs on"] == NVLINK
    assert hier["cp ring"]["GB over NVLink"] == 0 and hier["cp ring"]["runs on"] == NETWORK
    assert (
        hier["cp ring"]["GB across nodes"] + hier["cp all-to-all"]["GB across nodes"] < ulysses["cp"]["GB across nodes"]
    )
    assert link_name(cfg.replace(cp_kind="ulysses"), "cp", hardware_of("h100")) == NETWORK


def test_labkit_plan_prints_each_candidates_bytes_by_link():
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "plan", "--model", "llama3.1-70b", "--gpus", "512", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "over NVLink / across nodes" in text
    lines = text.split("over NVLink / across nodes")[1].strip().splitlines()[:3]
    assert [line.split()[0] for line in lines] == ["#1", "#2", "#3"] and all("/" in line for line in lines)


def test_the_planner_searches_hsdp_and_names_it():
    """theory.plan tries each sharded layout as HSDP too (a shard group of 1, 2, 4 or 8 nodes) and
    holds a given dp_replicate; a plan's line names the replicas."""
    from labkit import theory

    plans = theory.plan(LLAMA_70B, 512, "h100", top=20, fixed={"sharding": "fsdp", "tp": 1, "pp": 1, "cp": 1})
    replicas = {p.config.dp_replicate for p in plans}
    assert 1 in replicas and replicas - {1}, replicas  # flat FSDP and HSDP side by side
    hsdp = next(p for p in plans if p.config.dp_replicate > 1)
    assert f"× {hsdp.config.dp_replicate} replicas" in hsdp.layout()
    held = theory.plan(LLAMA_70B, 512, "h100", top=3, fixed={"dp_replicate": 8, "sharding": "fsdp"})
    assert held and {p.config.dp_replicate for p in held} == {8}
    # a shard group of one node cannot hold 70B's states (16 bytes a parameter over 8 GPUs): said so
    one_node = theory.plan(LLAMA_70B, 512, "h100", fixed={"dp_replicate": 64, "sharding": "fsdp", "tp": 1, "cp": 1})
    assert not one_node and any("does not fit" in why for why in one_node.counts)
