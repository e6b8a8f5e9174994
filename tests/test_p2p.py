"""Point-to-point on the 4-engine cluster goes out batched: with dist.isend / dist.irecv wrapped on
every rank, a training run's ring hops (cp) and pipeline sends and receives (pp) are each issued
from inside dist.batch_isend_irecv, never alone — under NCCL an unbatched pair deadlocks
(engines/p2p.py) — and each batch holds what the schedule says."""

from __future__ import annotations

import pytest
from conftest import TINY

from labkit import ParallelConfig
from labkit.config import RunSpec
from labkit.layout.schedules import Action, batches, schedule_table


def _run_watching_p2p(spec: dict) -> dict:
    """On one rank: run_rank(spec) with isend / irecv / batch_isend_irecv wrapped (in both of
    torch's namespaces: P2POp checks its op against distributed_c10d's). Returns the batches (the
    ops each issued) and the ops issued outside any batch."""
    import threading

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from labkit.engines.train import run_rank

    real = {name: getattr(c10d, name) for name in ("isend", "irecv", "batch_isend_irecv")}
    here = threading.local()
    seen = {"batches": [], "alone": []}

    def p2p(name):
        def call(tensor, *args, **kwargs):
            batch = getattr(here, "batch", None)
            (batch if batch is not None else seen["alone"]).append(name)
            return real[name](tensor, *args, **kwargs)

        return call

    def batch_isend_irecv(ops):
        here.batch = []
        try:
            return real["batch_isend_irecv"](ops)
        finally:
            seen["batches"].append(sorted(here.batch))
            here.batch = None

    wrapped = {"isend": p2p("isend"), "irecv": p2p("irecv"), "batch_isend_irecv": batch_isend_irecv}
    try:
        for name, fn in wrapped.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        run_rank(spec)
    finally:
        for name, fn in real.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
    assert dist.isend is real["isend"] and c10d.batch_isend_irecv is real["batch_isend_irecv"]
    return seen


def _spec(cfg: ParallelConfig, model=TINY, steps: int = 2) -> dict:
    return RunSpec(parallel=cfg, model=model, steps=steps).to_dict()


def test_ring_hops_are_batched(lab):
    """cp=4: each hop one batch of one send and one receive; 3(cp-1) hops per layer and step."""
    cp, steps = 4, 2
    got = lab.apply(_run_watching_p2p, _spec(ParallelConfig(cp=cp), steps=steps))
    for rank, seen in enumerate(got):
        assert seen["alone"] == [], (rank, seen["alone"][:4])
        assert seen["batches"] == [["irecv", "isend"]] * (3 * (cp - 1) * TINY.layers * steps), rank


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(pp=4, microbatches=4, schedule="1f1b"),
        ParallelConfig(pp=2, dp=2, microbatches=4, schedule="gpipe"),
        ParallelConfig(pp=2, dp=2, virtual_stages=2, microbatches=4, schedule="interleaved"),
        ParallelConfig(pp=4, microbatches=4, schedule="zbh1"),
        ParallelConfig(pp=2, dp=2, virtual_stages=2, microbatches=4, schedule="dualpipev"),
    ],
    ids=lambda c: f"pp{c.pp}-{c.schedule}",
)
def test_pipeline_sends_and_receives_are_batched_as_planned(lab, cfg):
    steps = 2
    got = lab.apply(_run_watching_p2p, _spec(cfg, TINY.replace(layers=4), steps))  # one layer per chunk at most
    issued = batches(schedule_table(cfg.schedule, cfg.pp, cfg.microbatches, cfg.virtual_stages))
    for rank, seen in enumerate(got):
        stage = rank // (4 // cfg.pp)  # pp is the outermost dim of the default order
        want = [
            sorted("isend" if a.op.startswith("send") else "irecv" for a in it)
            for it in issued[stage]
            if not isinstance(it, Action)
        ]
        assert seen["alone"] == [], (rank, seen["alone"][:4])
        assert seen["batches"] == want * steps, rank
