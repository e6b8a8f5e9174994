"""The dry run: one rank's real step at any scale, with a fake process group and fake tensors."""

from __future__ import annotations

import pytest
from conftest import TINY

from labkit import ConfigError, ModelConfig, ParallelConfig
from labkit.results.dryrun import dry_run


def test_the_private_pytorch_pieces_are_there():
    """engines/dryrun.py relies on these; if a PyTorch release moves them, this says so first."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    assert "fake" in dist.Backend.backend_list


def test_a_dry_run_measures_what_the_cluster_measures(lab):
    cfg = ParallelConfig(dp=4)
    d = dry_run(cfg, TINY, rank=1)
    assert d.differences() == []
    real = lab.run(cfg, model=TINY, steps=1).ranks[1]
    assert {k: d.report.memory[k] for k in ("params", "grads", "optimizer", "activations")} == {
        k: real.memory[k] for k in ("params", "grads", "optimizer", "activations")
    }
    assert d.comm_table() == [r for r in lab.run(cfg, model=TINY, steps=1).comm_table() if r["rank"] == 1]


def test_a_7b_wide_rank_of_128_equals_theory():
    """Llama-7B's width (2 of its 32 layers, to stay quick) on dp16 x tp8 + SP: rank 77 measured
    with nothing allocated — 4096-wide matrices, a 32000-token vocab split over 8 ranks."""
    model = ModelConfig(layers=2, hidden=4096, heads=32, ffn=16512, vocab=32000, seq=1024)
    cfg = ParallelConfig(dp=16, tp=8, sequence_parallel=True, global_batch=16)
    d = dry_run(cfg, model, rank=77)
    assert d.report.coords == {"tp": 5, "cp": 0, "ep": 0, "dp": 9, "pp": 0}
    assert d.differences() == []
    assert d.report.memory["params"] > 0 and {r["dim"] for r in d.comm_table()} == {
        "tp",
        "dp",
        "tp-dp",
    }  # SP LayerNorms: tp x dp


def test_bad_requests_are_refused():
    with pytest.raises(ConfigError, match="rank=9"):
        dry_run(ParallelConfig(dp=4), TINY, rank=9)
    with pytest.raises(ConfigError, match="MoE"):
        dry_run(ParallelConfig(dp=2), TINY.replace(experts=2))


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=2, tp=2, pp=2, microbatches=4, global_batch=16, sequence_parallel=True),
        ParallelConfig(tp=2, cp=2, pp=2, microbatches=2, global_batch=8),
        ParallelConfig(dp=2, tp=2, pp=2, microbatches=4, global_batch=16, sharding="zero1", precision="bf16"),
    ],
    ids=["dp2-tp2sp-pp2", "tp2-cp2-pp2", "zero1-dp2-tp2-pp2-bf16"],
)
def test_composed_layouts_dry_run_as_predicted(cfg):
    """The last rank (last pipeline stage: the head and the loss) of 3-D layouts, measured in one
    process, equals the theory: model states, every comm row, activations."""
    model = TINY.replace(layers=4)
    d = dry_run(cfg, model, rank=cfg.world - 1)
    assert d.differences(activation_tolerance=0.10) == []


def test_a_llama_70b_rank_of_1024_equals_theory():
    """GUIDE.md's claim ("At scale"): Llama-2-70B on dp32 x tp8 x pp4 (1,024 ranks), the last rank (last stage: the
    head and the loss; 20 of the 80 layers) measured with nothing allocated equals the theory
    (7 s on 2 CPU cores)."""
    from labkit.theory.presets import LLAMA_70B

    cfg = ParallelConfig(dp=32, tp=8, pp=4, microbatches=8, global_batch=256)
    d = dry_run(cfg, LLAMA_70B, rank=1023)
    assert d.report.coords == {"tp": 7, "cp": 0, "ep": 0, "dp": 31, "pp": 3}
    assert d.differences() == []
