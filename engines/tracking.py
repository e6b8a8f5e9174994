"""labkit.track and labkit.region: what a user's own training code tells the meters, on one rank.

Lab.measure (engines/measure.py) runs a user's function on every rank inside a Tracker, under
the job's collective log (every collective, whoever issues it, as in a run). What the log cannot
know, the user says with two calls:

    labkit.track(model, optimizer, mesh)   # the model's forward, the backward it starts and the
                                           # optimizer's step become phases and spans; its
                                           # parameters, gradients and optimizer state the model
                                           # states; the mesh names the collectives' dims
    with labkit.region("name"): ...        # a span of the user's own on the timeline

Phases and spans come from hooks: a forward pre-hook on the model (prepended, so that FSDP2's
all-gathers in its own pre-hook count as forward) opens an F span per microbatch; a hook on the
forward's outputs (put there before FSDP2's own) fires when the backward reaches them (its
start) and queues a callback on the
autograd engine that runs when the whole graph task is done (its end: after DDP's and FSDP2's
own final callbacks, which is when their gradients are reduced); the optimizer's step hooks
bracket 'opt'. A step ends with each optimizer step (without an optimizer, with each backward)
and the next begins there; what ran before the first tracked forward is set-up (step -1).

Outside Lab.measure both calls do nothing, so the same function runs alone or under lab.apply.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from labkit.engines import runtime
from labkit.engines.mesh import Mesh
from labkit.engines.meters.bundle import dims_by_ranks
from labkit.engines.meters.memory import MemoryMeter, unique_bytes
from labkit.engines.meters.timeline import Timeline

USER = "user"
"""The phase of everything outside a tracked forward, backward and optimizer step."""


def device_mesh_dims(mesh: DeviceMesh) -> tuple[dict[tuple[int, ...], str], dict[str, int]]:
    """(group ranks -> dim name, this rank's coordinates) of a torch DeviceMesh: each dim's groups
    and, for every combination of dims, the combined groups ('dp-tp'); a single dim wins over a
    combination with the same ranks, as for labkit's own mesh (engines/meters/bundle.py)."""
    grid = mesh.mesh  # (size_0, size_1, ...) of global ranks
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(grid.ndim)])
    out: dict[tuple[int, ...], str] = {}
    for k in range(1, grid.ndim + 1):
        for axes in itertools.combinations(range(grid.ndim), k):
            rest = [a for a in range(grid.ndim) if a not in axes]
            size = 1
            for a in axes:
                size *= grid.shape[a]
            rows = grid.permute(*rest, *axes).reshape(-1, size)  # one row per group
            for row in rows.tolist():
                if len(row) > 1:
                    out.setdefault(tuple(sorted(row)), "-".join(names[a] for a in axes))
    coords = {}
    for i, name in enumerate(names):
        local = mesh.get_local_rank(i)
        if local is not None:
            coords[name] = int(local)
    return out, coords


def _tensors(value):
    """Every tensor in a (nested) output or optimizer state: tensors, tuples, lists, dicts
    (Hugging Face's ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class Tracker:
    """The meters of one Lab.measure on one rank: the job's collective log (`comm`), a memory
    meter and a timeline, with the phases and steps the tracked modules' hooks set.
    `Tracker.current` is the active one (one job at a time per engine)."""

    current: Tracker | None = None

    def __init__(self, comm, device: torch.device, world: int, rank: int = 0):
        self.comm = comm
        self.rank = rank
        self.first = len(comm.events)  # the measurement's slice of the log starts here
        self.device = device
        self.world = world
        self.cuda = device.type == "cuda"
        self.memory = MemoryMeter()
        self.timeline = Timeline(device)
        self.timeline.step = 0
        self.dims: dict[tuple[int, ...], str] = {}
        self.coords: dict[str, int] = {}
        self.modules: list[nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.states: dict[str, int] | None = None  # sampled after each optimizer step
        self.started = False  # a tracked forward has run: steps count from it
        self.step = 0
        self.step_open = False
        self.steps = 0
        self.microbatch = 0
        self.waiting: list[int] = []  # microbatches whose backward has not started
        self._depth = 0
        self._stepping = 0  # tracked optimizer steps open: a wrapper's step calls the optimizer inside it
        self._spans: dict[str, object] = {}
        self._hooks: list = []
        comm.step, comm.phase = 0, USER

    # -- what the user tells --------------------------------------------------------------
    def add(self, model=None, optimizer=None, mesh=None) -> None:
        for m in model if isinstance(model, (list, tuple)) else [model]:
            if m is not None and not any(m is k for k in self.modules):
                self._hook_module(m)
        for o in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            if o is not None and not any(o is k for k in self.optimizers):
                self.optimizers.append(o)
                self._hooks.append(o.register_step_pre_hook(lambda *_: self._optimizer_begins()))
                self._hooks.append(o.register_step_post_hook(lambda *_: self._optimizer_ends()))
        if mesh is not None:
            if isinstance(mesh, Mesh):
                dims, coords = dims_by_ranks(mesh), dict(mesh.coords)
            elif isinstance(mesh, DeviceMesh):
                dims, coords = device_mesh_dims(mesh)
            else:
                raise TypeError(f"mesh={mesh!r}: pass a torch DeviceMesh or a labkit Mesh")
            self.dims.update(dims)
            self.coords.update(coords)
            self.comm.dims_by_ranks.update(dims)  # a hang diagnosed mid-run names them too

    def _hook_module(self, model: nn.Module) -> None:
        self.modules.append(model)
        self.memory.exclude(model.parameters())
        self._hooks.append(model.register_forward_pre_hook(self._forward_begins, prepend=True))
        # prepended too: the backward hooks it puts on the outputs must come before FSDP2's
        # pre-backward hooks (which all-gather for backward) on the same tensors
        self._hooks.append(model.register_forward_hook(self._forward_ends, prepend=True))
        for sub in model.modules():
            # after FSDP2's own pre-hook has swapped in the unsharded parameters (views of its
            # all-gather output): those storages are parameters, not activations
            self._hooks.append(sub.register_forward_pre_hook(self._exclude_parameters))

    def _exclude_parameters(self, module, args) -> None:
        self.memory.exclude(module.parameters(recurse=False))

    # -- steps ------------------------------------------------------------------------------
    # A step runs from the end of the previous one (or the first tracked forward) to the end of
    # its optimizer step (without an optimizer, of its backward): what the user does between
    # two steps (loading data, a region) belongs to the next.
    def _open_step(self) -> None:
        if not self.started:  # what ran so far was set-up
            self.started = True
            for e in self.comm.events[self.first :]:
                e["step"], e["phase"] = -1, "setup"
            for e in self.timeline.events:
                e["step"] = -1
        self.step_open, self.microbatch = True, 0
        self.opened = time.perf_counter()
        self.steps = self.step + 1
        self.comm.step = self.step
        self.timeline.begin_step(self.step)
        self.memory.set_states(sum(self.model_states().values()))
        self.memory.reset_peaks()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _close_step(self) -> None:
        if not self.step_open:
            return
        self.timeline.end_step()
        self.step_open = False
        runtime.progress(step=self.step, rank=self.rank, seconds=round(time.perf_counter() - self.opened, 3))
        self.step += 1
        self.comm.step = self.timeline.step = self.step

    def _phase(self, name: str) -> None:
        self.comm.phase = name

    def _begin(self, kind: str, microbatch=None) -> None:
        span = self.timeline.span(kind, microbatch)
        span.__enter__()
        self._spans[kind] = span

    def _end(self, kind: str) -> None:
        span = self._spans.pop(kind, None)
        if span is not None:
            span.__exit__(None, None, None)

    # -- hooks ------------------------------------------------------------------------------
    def _forward_begins(self, module, args) -> None:
        self._depth += 1
        if self._depth > 1:  # a tracked module inside another tracked one
            return
        if not self.step_open:
            self._open_step()
        self._phase("forward")
        self._begin("F", self.microbatch)

    def _forward_ends(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth:
            return
        self._end("F")
        self.waiting.append(self.microbatch)
        self.microbatch += 1
        self._phase(USER)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self._backward_begins)

    def _backward_begins(self, grad) -> None:
        if "B" in self._spans:
            return  # another output of the same forward
        self._phase("backward")
        self._begin("B", self.waiting.pop(0) if self.waiting else None)
        engine = torch.autograd.Variable._execution_engine
        # queued twice: DDP's reducer queues its final callback after this hook (at the first
        # gradient), and the engine runs callbacks queued by callbacks last
        engine.queue_callback(lambda: engine.queue_callback(self._backward_ends))

    def _backward_ends(self) -> None:
        self._end("B")
        self._phase(USER)
        if not self.optimizers:
            self.states = self.model_states()
            self._close_step()

    def _optimizer_begins(self) -> None:
        self._stepping += 1
        if self._stepping > 1:  # the optimizer inside a tracked wrapper: one step, one span
            return
        self._phase("optimizer")
        self._begin("opt")

    def _optimizer_ends(self) -> None:
        self._stepping -= 1
        if self._stepping:
            return
        self._end("opt")
        self._phase(USER)
        self.states = self.model_states()
        self._close_step()

    # -- the report -------------------------------------------------------------------------
    def model_states(self) -> dict[str, int]:
        """Bytes of the tracked parameters, their gradients and the optimizers' state tensors
        (unique storages: a flat buffer behind many views counts once; a DTensor's local shard)."""
        params = [p for m in self.modules for p in m.parameters()]
        params += [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        state = [t for o in self.optimizers for s in o.state.values() for t in _tensors(s)]
        return {
            "params": unique_bytes(params),
            "grads": unique_bytes(p.grad for p in params),
            "optimizer": unique_bytes(state),
        }

    def take(self, value):
        """fn's return value with the modules, optimizers and meshes it returned taken out and
        tracked (a function may return them instead of calling labkit.track: their states count).
        A tuple or list keeps its other items (one left: that item; none: None)."""

        def tracked(v) -> bool:
            if isinstance(v, nn.Module):
                self.add(model=v)
            elif isinstance(v, torch.optim.Optimizer):
                self.add(optimizer=v)
            elif isinstance(v, (DeviceMesh, Mesh)):
                self.add(mesh=v)
            else:
                return False
            return True

        if not isinstance(value, (tuple, list)):
            return None if tracked(value) else value
        rest = [v for v in value if not tracked(v)]
        if len(rest) == len(value):
            return value
        return rest[0] if len(rest) == 1 else (type(value)(rest) if rest else None)

    def dim(self, group: list[int]) -> str:
        """The name of a group: its mesh dim when a mesh was tracked, else 'world' or its ranks."""
        found = self.dims.get(tuple(group))
        if found:
            return found
        return "world" if len(group) == self.world else "ranks " + ",".join(map(str, group))

    def finish(self) -> None:
        """Take the hooks out and close what is open (also after an exception in fn)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for kind in list(self._spans):
            self._end(kind)
        self._close_step()
        if self.started:  # what ran after the last step (a logging all-reduce) belongs to it
            for e in self.comm.events[self.first :]:
                e["step"] = min(e["step"], self.steps - 1)
            for e in self.timeline.events:
                e["step"] = min(e["step"], self.steps - 1)
        if self.states is None:
            self.states = self.model_states()

    def memory_report(self) -> dict[str, int]:
        """Like a run's: model states (after the last optimizer step, else at the end), the
        activations' peak in the last step, and the peak (CUDA's allocator, else the meters')."""
        out = dict(self.states)
        out["activations"] = self.memory.peak_of.get("activations", 0)
        if self.cuda:
            out["peak"] = int(torch.cuda.max_memory_allocated(self.device))
        else:
            out["peak"] = int(max(self.memory.peak, sum(self.states.values())))
        return out

    def comm_events(self) -> list[dict]:
        """The measurement's collectives as CommEvent dicts, each named by its group (`dim`)."""
        self.comm.sweep()
        return [
            {**{k: v for k, v in e.items() if k not in ("pg", "members", "error")}, "dim": self.dim(e["group"])}
            for e in self.comm.events[self.first :]
            if e["op"] != "new_group"
        ]


def track(model=None, optimizer=None, mesh=None) -> None:
    """Inside lab.measure: `model` (a module or a list of them) and `optimizer` (one or a list)
    are what the meters follow — their forward, backward and step become the timeline's F, B and
    opt and the comm log's phases; their parameters, gradients and state the memory's model
    states (parameters are never counted as activations). `mesh` (a torch DeviceMesh or a labkit
    Mesh) names each collective's dim; without one a collective is named by its group's ranks.
    Outside lab.measure it does nothing."""
    tracker = Tracker.current
    if tracker is not None:
        tracker.add(model, optimizer, mesh)


@contextmanager
def region(name: str):
    """Inside lab.measure: a span called `name` on this rank's timeline (and in the trace).
    Outside lab.measure it does nothing."""
    tracker = Tracker.current
    if tracker is None:
        yield
        return
    with tracker.timeline.span(name, region=True):
        yield
