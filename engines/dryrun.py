"""One rank's real training step at full scale, with nothing computed or allocated.

The rank joins PyTorch's fake process group (backend "fake" with its FakeStore: any world
size in one process, collectives return at once) and runs `train.run_rank` — the same mesh,
model, strategies and meters as on the cluster — under a FakeTensorMode, so every tensor has
its real shape and dtype but no data. The meters then measure that rank's collectives (op,
group, bytes) and its model-state and activation bytes exactly, for a Llama-70B on 1,024
ranks, on a laptop.

Values that would need data come back as NaN (losses, gradient norms; clipping then leaves
the gradients as they are). Layouts whose communication depends on data — MoE routing, whose
all-to-all split sizes are the token counts per expert — are refused.

Private PyTorch pieces used (tests/test_dryrun.py checks they are still there):
torch.testing._internal.distributed.fake_pg.FakeStore, torch._subclasses.fake_tensor.FakeTensorMode.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from labkit.config import RunSpec
from labkit.engines import runtime
from labkit.engines.mesh import Mesh
from labkit.engines.meters import comm
from labkit.engines.train import run_rank


def _fake_mode():
    class ShapesOnly(FakeTensorMode):
        """Fake tensors whose scalar reads (`float(loss)`, `.item()`) give NaN instead of raising."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return float("nan")
            return super().__torch_dispatch__(func, types, args, kwargs)

    return ShapesOnly()


def dry_run_rank(spec: dict, rank: int, world: int) -> dict:
    """Run spec (a RunSpec as plain data, as Lab.run sends it) as rank `rank` of a fake world of
    `world` ranks; nothing to bring back (no parameters) and nothing to audit."""
    run = RunSpec.from_dict(spec).replace(return_params=False, audit=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    Mesh.forget_groups()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    comm.install()
    runtime._state.runtime = runtime.Runtime(rank, world, "fake", "cpu", socket.gethostname(), 0.0, 0)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        with _fake_mode():
            report = run_rank(run.to_dict())
    finally:
        runtime._state.runtime = None
        Mesh.forget_groups()
        dist.destroy_process_group()
    report["dry_run_seconds"] = time.perf_counter() - t0
    return report
