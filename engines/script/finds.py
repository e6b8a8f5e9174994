"""What a script's own code tells the meters without a line of labkit in it: the models, optimizers
and meshes it builds, found where PyTorch builds them, and its NCCL refused on a rank without a GPU.

Each find wraps one public constructor or function and hands what it built to the Tracker
(engines/tracking.py), as `labkit.track` would:

  DistributedDataParallel(module)      the wrapper is the model: its forward, backward, parameters
  fully_shard(module, mesh=...)        FSDP2: each sharded module (the root's hooks count, nested
                                       ones are inside it), and its mesh's dims
  parallelize_module(module, mesh, p)  DTensor TP: the root module and the mesh
  PipelineStage(submod, ...)           torch.distributed.pipelining: the stage's module
  torch.optim.Optimizer(...)           every optimizer built through its base class (a wrapper such
                                       as accelerate's, which never calls it, steps one inside)
  DeviceMesh(...)                      a mesh with named dims names its groups' collectives

Functions are replaced where the script imports them from (the package's namespace), after that
package is imported: `fully_shard`, `parallelize_module` and `PipelineStage` load ~1.4 s and ~145 MB
a process, which a script that uses none of them should not pay (`AfterImport`). A find never changes
what the script computes: one that fails is noted and the script runs on.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

NOTES: list[str] = []
"""Finds that failed (kept in the rank's report): the measurement misses what they would have found."""


def _safely(what: str, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # a find must never break the script it measures
        NOTES.append(f"{what}: {type(e).__name__}: {e}")


def install(tracker, *, rank: int, host: str) -> None:
    """Every find, on this process, for `tracker`."""

    def after_init(cls, found):
        original = cls.__init__

        @functools.wraps(original)
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _safely(cls.__name__, found, self)

        cls.__init__ = init

    after_init(DistributedDataParallel, lambda ddp: tracker.add(model=ddp))
    after_init(torch.optim.Optimizer, lambda opt: tracker.add(optimizer=opt))
    after_init(DeviceMesh, lambda mesh: mesh.mesh_dim_names and tracker.add(mesh=mesh))
    _refuse_nccl_without_gpu(rank, host)

    def shard(module):
        fully_shard = module.fully_shard

        @functools.wraps(fully_shard)
        def wrapped(modules, *args, **kwargs):
            out = fully_shard(modules, *args, **kwargs)
            mesh = kwargs.get("mesh")
            _safely("fully_shard", tracker.add, out, None, mesh if mesh is not None and mesh.mesh_dim_names else None)
            return out

        for name in ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard"):
            if name in sys.modules:
                sys.modules[name].fully_shard = wrapped

    def parallelize(module):
        parallelize_module = module.parallelize_module

        @functools.wraps(parallelize_module)
        def wrapped(model, device_mesh=None, *args, **kwargs):
            out = parallelize_module(model, device_mesh, *args, **kwargs)
            mesh = device_mesh if device_mesh is not None and device_mesh.mesh_dim_names else None
            _safely("parallelize_module", tracker.add, out, None, mesh)
            return out

        module.parallelize_module = wrapped

    def stage(module):
        after_init(module.PipelineStage, lambda st: tracker.add(model=st.submod))

    sys.meta_path.insert(
        0,
        AfterImport(
            {
                "torch.distributed.fsdp": shard,
                "torch.distributed.tensor.parallel": parallelize,
                "torch.distributed.pipelining": stage,
            }
        ),
    )


def _refuse_nccl_without_gpu(rank: int, host: str) -> None:
    """init_process_group('nccl') on a rank whose engine has no GPU fails at once, saying so: labkit runs
    the script as it is written and never swaps its backend behind its back."""
    original = distributed_c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if backend is not None and "nccl" in str(backend).lower() and not torch.cuda.is_available():
            raise RuntimeError(
                f"this script asks for the NCCL backend (init_process_group({backend!r})), and rank {rank} runs "
                f"on {host}, which has no GPU: labkit runs the script as written and does not replace NCCL with "
                "gloo. Run it on a Lab with a GPU per rank, or let the script choose gloo on the CPU "
                "(init_process_group('gloo'), or no backend: PyTorch then picks gloo for CPU tensors)"
            )
        return original(backend, *args, **kwargs)

    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group  # torch.distributed re-exports the same function


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs `patches[name](module)` right after the module `name` is first executed (an import hook:
    Python has no post-import hook of its own). The module itself is found by the finders after it."""

    def __init__(self, patches: dict):
        self.patches = dict(patches)

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                patch, loader = self.patches.pop(name), spec.loader
                execute = loader.exec_module

                def exec_module(module, execute=execute, patch=patch):
                    execute(module)
                    _safely(name, patch, module)

                loader.exec_module = exec_module
                return spec
        return None
