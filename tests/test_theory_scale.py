"""The estimate at scale: one representative rank per class must give exactly what computing
every rank gives (checked on many small layouts), and large layouts must be cheap."""

from __future__ import annotations

import itertools

import pytest

from labkit import ModelConfig, ParallelConfig, theory
from labkit.config.validation import problems
from labkit.layout.mesh import MeshLayout
from labkit.theory.exact import comm as tcomm
from labkit.theory.exact.per_rank import comm_rows, rank_memory

MODEL = ModelConfig(layers=4, hidden=32, heads=4, ffn=128, vocab=128, seq=32, experts=0)
MOE = MODEL.replace(experts=4, top_k=2)


def _layouts():
    for dp, tp, pp, cp, ep in itertools.product([1, 2], [1, 2], [1, 2], [1, 2], [1, 2]):
        for model in [MODEL, MOE] if ep == 1 else [MOE]:
            for sharding in ("none", "zero1", "fsdp"):
                for order in ("tp-cp-ep-dp-pp", "dp-pp-tp-cp-ep"):
                    cfg = ParallelConfig(
                        dp=dp,
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        ep=ep,
                        sharding=sharding,
                        order=order,
                        microbatches=2,
                        global_batch=16,
                    )
                    if not problems(cfg, model):
                        yield cfg, model


CASES = list(_layouts())


def test_enough_layouts():
    assert len(CASES) > 100


@pytest.mark.parametrize("cfg, model", CASES[::3])
def test_representatives_equal_every_rank(cfg, model):
    est = theory.estimate(cfg, model)
    layout = MeshLayout.of(cfg)
    full = tcomm.Comm()
    comm_rows(full, cfg, model, layout)
    assert est.comm_table() == full.table()
    assert est.memory == [rank_memory(cfg, model, layout, r) for r in range(layout.world)]


def test_405b_on_16384_gpus_is_a_small_computation():
    m405 = ModelConfig(layers=126, hidden=16384, heads=128, ffn=64512, vocab=128256, seq=8192)
    cfg = ParallelConfig(dp=1024, tp=8, pp=2, microbatches=4, global_batch=4096)
    est = theory.estimate(cfg, m405)
    assert len(est.memory) == 16384 and len(est.rows_of) == 2  # one class per pipeline stage
    assert est.memory[0]["params"] == est.memory[8191]["params"]  # symmetric over tp and dp
    rows = est.rank_rows(16383)
    assert {r["dim"] for r in rows} >= {"tp", "dp", "pp"}
