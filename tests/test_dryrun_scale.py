"""Real architectures at full size, one rank each, through the dry run (a fake process group and
fake tensors: labkit/results/dryrun.py): what the engines measure equals the theory exactly — model
states, activations, every comm row. 8B 4 s, each 70B rank 9 s on the 2-core CI machine (50 s and 75 s
while the dry run still made its batch token by token: engines/data.py `batch(shapes_only=...)`)."""

from __future__ import annotations

import pytest

from labkit import ParallelConfig
from labkit.results.dryrun import dry_run
from labkit.theory.presets import LLAMA31_8B, LLAMA31_70B

CFG_70B = ParallelConfig(
    dp=32,
    tp=8,
    pp=4,
    microbatches=8,
    global_batch=256,
    sequence_parallel=True,
    precision="bf16",
    sharding="zero1",
)
"""Llama 3.1 70B on 1,024 ranks: tp8 (8 KV heads, one per rank) with SP, 20 layers per stage."""


def test_llama31_8b_fsdp_over_8_equals_theory():
    """torchtitan's Llama 3.1 8B layout (FSDP over 8 GPUs, local batch 2, seq 8192, bf16, full
    activation checkpointing), with labkit's FSDP."""
    cfg = ParallelConfig(dp=8, sharding="fsdp", precision="bf16", global_batch=16, checkpoint_activations=True)
    d = dry_run(cfg, LLAMA31_8B, rank=3, timeout=900)
    assert d.differences(activation_tolerance=0.0) == []
    # bf16 shards of the published 8,030,261,248 parameters, each of the 33 units (32 blocks and the
    # root) padded to a multiple of 8 elements
    assert 0 <= 8 * d.report.memory["params"] - 2 * 8_030_261_248 < 2 * 8 * 33


@pytest.mark.parametrize("rank", [0, CFG_70B.world - 1], ids=["first-stage", "last-stage"])
def test_llama31_70b_3d_rank_equals_theory(rank):
    d = dry_run(CFG_70B, LLAMA31_70B, rank=rank, timeout=1200)
    assert d.report.coords["pp"] == (0 if rank == 0 else 3)
    assert d.differences(activation_tolerance=0.0) == []
