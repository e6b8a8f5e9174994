"""A classroom's GPU server on a real GPU (marked gpu: skipped without CUDA; the CPU side of the
choice is tests/test_launchers.py): the engines see only the GPUs chosen for them, several ranks
share one (on NCCL where it runs two ranks on one GPU, >= 2.30, else gloo on CUDA tensors), and
each rank's allocator stops at its cap instead of taking a neighbour's memory."""

from __future__ import annotations

import pytest
from conftest import TINY

from labkit import ParallelConfig
from labkit.oracle.checks import assert_matches

pytestmark = pytest.mark.gpu


def _what_this_rank_sees():
    import os

    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count(), str(torch.cuda.current_device())


def _allocate(fraction: float) -> str:
    """Try to allocate `fraction` of this rank's GPU: 'ok' or the error's name."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        x = torch.empty(int(total * fraction), dtype=torch.uint8, device="cuda")
        del x
        return "ok"
    except torch.OutOfMemoryError:
        return "OutOfMemoryError"
    finally:
        torch.cuda.empty_cache()


def test_two_ranks_share_the_chosen_gpu_each_capped(ref_cache):
    import torch

    from labkit import Lab
    from labkit.cluster.world import NCCL_SHARED_SINCE
    from labkit.engines.host import nccl_version

    with Lab(engines=2, gpus="auto", ranks_per_gpu=2, gpu_memory_fraction=0.25, progress=False, timeout=300) as lab:
        assert lab.devices == ["cuda:0", "cuda:0"]  # the GPU is shared
        # two students' ranks on one card over NCCL where it runs two ranks on one GPU (>= 2.30)
        want = "nccl" if (nccl_version() or (0,)) >= NCCL_SHARED_SINCE else "gloo"
        assert lab.backend == want, lab.backend_reason
        seen = lab.apply(_what_this_rank_sees)
        assert len({s[0] for s in seen}) == 1 and all(s[1] == 1 for s in seen)  # one GPU visible, the same
        assert lab.apply(_allocate, 0.1) == ["ok", "ok"]
        assert lab.apply(_allocate, 0.5) == ["OutOfMemoryError"] * 2  # past the 25% cap
        res = lab.run(ParallelConfig(dp=2), model=TINY, steps=3, return_params=True)
        assert_matches(res, ref_cache())
    if torch.cuda.device_count() > 1:
        with Lab(engines=2, gpus=[1], progress=False, timeout=300) as lab:
            assert [s[0] for s in lab.apply(_what_this_rank_sees)] == ["1", "1"]
