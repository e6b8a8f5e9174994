"""ipyparallel's %px / %%px magics on a Lab's engines (Lab.activate), each engine's namespace
ready for distributed code: rank, world_size, mesh, device, torch and dist; and %%torchrun, a cell
run as a training script on every rank (Lab.torchrun).

It only prepares the namespaces and registers the magics; the engines and their process groups
are the Lab's (labkit/cluster/engine_set.py).
"""

from __future__ import annotations

import shlex

from labkit.cluster.script import torchrun
from labkit.config import ConfigError, ParallelConfig
from labkit.engines import runtime
from labkit.layout.mesh import MeshLayout


def _build_mesh(layout) -> None:
    """On every rank (through Lab.apply): create the layout's groups, cached for Mesh.build."""
    from labkit.engines.mesh import (
        Mesh,  # imports torch: it runs on the engines, never in the kernel
    )

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
    cfg = cfg or lab.last_config or ParallelConfig(dp=lab.world)
    if not isinstance(cfg, ParallelConfig) or cfg.world > lab.world:
        raise ConfigError([f"cfg={cfg!r} must be a ParallelConfig of at most {lab.world} ranks"])
    layout = MeshLayout.of(cfg)
    lab.apply(_build_mesh, layout)  # every rank creates the groups, in order
    engines = lab.engines
    with engines.lock:
        engines.push([{"rank": rank, "world_size": lab.world, "_lk_layout": layout} for rank in range(lab.world)])
        engines.execute(_PX_SETUP)
        view = engines.view()  # its own view: blocking, as a cell expects
        view.block = True
        view.activate(suffix)  # warns (and registers nothing) outside IPython
        from IPython import get_ipython  # heavy; only activate needs it

        if get_ipython() is not None:  # whole outputs after the cell, in rank order
            get_ipython().run_line_magic("pxconfig" + suffix, "--no-stream")
            get_ipython().register_magic_function(torchrun_magic(lab), "cell", "torchrun" + suffix)
    return view


def torchrun_magic(lab):
    """%%torchrun [--timeout S] [args...]: the cell's source as a script, run on every rank of `lab`
    as `torchrun --nproc-per-node <ranks> cell.py args` would (Lab.torchrun: the working directory is
    the notebook's, importable from the script). Returns the ScriptResult, which the cell shows."""

    def magic(line: str, cell: str):
        try:
            words = shlex.split(line)
        except ValueError as e:  # an unclosed quote: the line is the script's argv, as a shell splits it
            raise ConfigError([f"%%torchrun {line}: {e}; quote the arguments as a shell would"]) from None
        timeout = None
        if words[:1] == ["--timeout"]:
            try:
                timeout, words = float(words[1]), words[2:]
            except (IndexError, ValueError):
                raise ConfigError(
                    [f"%%torchrun {line}: --timeout needs seconds, e.g. %%torchrun --timeout 60 --steps 3"]
                ) from None
        return torchrun(lab, "cell.py", words, source=cell, timeout=timeout)

    return magic
