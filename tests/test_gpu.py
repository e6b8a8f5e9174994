"""The GPU path (marked `gpu`, skipped without CUDA): NCCL, the allocator's memory, CUDA-event
timelines, and ranks sharing one GPU through gloo. Run on a GPU server with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from labkit import Lab, ModelConfig, ParallelConfig, reference
from labkit.checks import assert_matches

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=256, seq=64)


@pytest.fixture(scope="module")
def gpu_lab():
    n = torch.cuda.device_count()
    with Lab(engines=n, timeout=300, progress=False) as lab:
        yield lab


def test_nccl_is_chosen_when_every_engine_has_a_gpu(gpu_lab):
    assert gpu_lab.backend == "nccl"
    assert all(d.startswith("cuda:") for d in gpu_lab.devices)
    assert len(set(gpu_lab.devices)) == gpu_lab.world  # one GPU each


def test_ddp_on_nccl_trains_like_one_process(gpu_lab):
    cfg = ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world)
    res = gpu_lab.run(cfg, model=MODEL, steps=3, return_params=True)
    # the reference runs on the CPU; GPU kernels sum in another order, well inside 1e-5 in fp32
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))


def test_cuda_memory_comes_from_the_allocator(gpu_lab):
    res = gpu_lab.run(ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world), model=MODEL, steps=2)
    for rk in res.ranks:
        m = rk.memory
        states = m["params"] + m["grads"] + m["optimizer"]
        # max_memory_allocated holds the states, the activations and the kernels' workspaces
        assert m["peak"] >= states + m["activations"]
        assert m["peak"] < 20 * (states + m["activations"])


def test_timeline_from_cuda_events_is_ordered(gpu_lab):
    res = gpu_lab.run(
        ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world, microbatches=2), model=MODEL, steps=2
    )
    for rk in res.ranks:
        spans = [e for e in rk.timeline if e.step == 1 and e.kind in ("F", "B")]
        assert [(e.kind, e.microbatch) for e in spans] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
        assert all(e.end > e.start for e in spans)
        assert all(a.end <= b.start + 1e-4 for a, b in zip(spans, spans[1:]))  # one stream: in order


def test_bf16_on_gpu(gpu_lab):
    """Against the fp32 reference (on the CPU), with the bounds derived from bf16's rounding
    (labkit/bounds.py): CUDA's bf16 kernels round like any others."""
    cfg = ParallelConfig(
        dp=gpu_lab.world,
        global_batch=8 * gpu_lab.world,
        precision="bf16",
        sharding="zero1" if gpu_lab.world > 1 else "none",
    )
    res = gpu_lab.run(cfg, model=MODEL, steps=3, return_params=True)
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))


def test_ranks_share_one_gpu_through_gloo():
    """NCCL refuses two ranks on one GPU; device='cuda' with more engines than GPUs runs gloo on
    CUDA tensors (tensors stay on the GPU, gloo stages them through the host)."""
    n = torch.cuda.device_count() + 1
    with Lab(engines=n, device="cuda", progress=False, timeout=300) as lab:
        assert lab.backend == "gloo" and all(d.startswith("cuda:") for d in lab.devices)
        cfg = ParallelConfig(dp=n, global_batch=4 * n)
        res = lab.run(cfg, model=MODEL, steps=3, return_params=True)
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))
