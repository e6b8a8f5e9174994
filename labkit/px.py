"""%px / %%px on a Lab's engines (Lab.activate): each engine's namespace ready for distributed code.

Kept apart from lab.py, which sets up the cluster and runs jobs; this only prepares the
engines' namespaces and registers ipyparallel's magics.
"""
from __future__ import annotations

from labkit.config import ConfigError, ParallelConfig
from labkit.plans.mesh import MeshLayout


def _build_mesh(layout) -> None:
    """On every rank (through Lab.apply): create the layout's groups, cached for Mesh.build."""
    from labkit.engines import runtime
    from labkit.engines.mesh import Mesh

    Mesh.build(layout, runtime.current().rank)


_PX_SETUP = """\
import torch
import torch.distributed as dist
from labkit.engines import runtime as _lk_runtime
from labkit.engines.mesh import Mesh as _lk_Mesh
assert _lk_runtime.current().rank == rank and dist.is_initialized()
mesh = _lk_Mesh.build(_lk_layout, rank)   # cached by the apply before: no collective here
device = torch.device(_lk_runtime.current().device)
del _lk_layout, _lk_runtime, _lk_Mesh
"""
"""What %%px cells find on every engine (rank and world_size are pushed per engine first)."""


def activate(lab, cfg: ParallelConfig | None = None, suffix: str = ""):
    """Lab.activate (its docstring says what the engines get): build the mesh on every rank,
    push rank / world_size, run the set-up, register the magics. Returns the DirectView."""
    from labkit.lab import START_TIMEOUT_S

    cfg = cfg or lab.last_config or ParallelConfig(dp=lab.world)
    if not isinstance(cfg, ParallelConfig) or cfg.world > lab.world:
        raise ConfigError([f"cfg={cfg!r} must be a ParallelConfig of at most {lab.world} ranks"])
    layout = MeshLayout.of(cfg)
    lab.apply(_build_mesh, layout)                       # every rank creates the groups, in order
    with lab._lock:
        pushed = [lab.client[eid].push({"rank": rank, "world_size": lab.world, "_lk_layout": layout},
                                        block=False) for rank, eid in enumerate(lab.ids)]
        for ar in pushed:
            ar.get(timeout=START_TIMEOUT_S)
        view = lab.client[lab.ids]          # its own view: blocking, as a cell expects
        view.block = True
        view.execute(_PX_SETUP, block=False).get(timeout=START_TIMEOUT_S)
        view.activate(suffix)             # warns (and registers nothing) outside IPython
        from IPython import get_ipython

        if get_ipython() is not None:     # whole outputs after the cell, in rank order
            get_ipython().run_line_magic("pxconfig" + suffix, "--no-stream")
    return view
