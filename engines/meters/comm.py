"""The communication meter: every collective and point-to-point op a rank issues.

How it sees them. `install()` registers one small Python kernel for each `c10d::*` op at the
BackendSelect dispatch key, then re-dispatches to the real (CPU or CUDA) kernel. Every
process-group op reaches the dispatcher as a c10d op, whoever issues it — our code, PyTorch
DDP's C++ reducer (its bucket all-reduces and its bucket-order broadcasts), the functional
collectives (their kernels call the ProcessGroup, which calls the c10d op), FSDP2, DTensor,
torch.distributed.pipelining — so this one hook sees them all, while the model's own ops never
touch Python. BackendSelect rather than an Autograd key: DTensor issues the collectives of its
sharding propagation (loss_parallel's reductions, a clip_grad_norm_ over sharded gradients)
from inside its own dispatch, where the Autograd keys are already excluded; BackendSelect is
still ahead of them. (A TorchDispatchMode would see them too, but it sends every aten op
through Python: 35-130% slower steps on the lab's models, measured. It is kept as
`CommAudit` (engines/meters/audit.py), which the tests run beside this meter to prove it missed nothing.)

What it records, per op (a plain dict, see labkit.results.run.CommEvent): op, dim (the mesh
dimension whose group it ran on), group ranks, numel, dtype, payload bytes (B: the logical full
tensor), wire bytes this rank sends under the ring model (labkit/layout/wire.py), a sequence
number per group, start/end on the run's clock, and the phase of the step. An op is 'left' when
its Work completes: for a blocking call of torch.distributed's Python API (`dist.all_reduce(t)`
without async_op: most of labkit's own collectives) when that call returns, its wait done
(`_blocking`); else from a future callback, or for works without a future (gloo's reduce-scatter),
ops on CUDA tensors (see `watch`) and CUDA ops with no Work (a blocking NCCL collective:
engines/meters/stream_mark.py), when the meter next finds it completed. Entered-but-not-left ops
are what the hang diagnosis reads. An op whose Work fails (a peer died, gloo's timeout) is never
'left': it keeps end None and gets an 'error'. Each event also names its process group ('pg'):
the sequence numbers count per process group, so the diagnosis compares ranks' ops only within one group.

The meter of a Lab job is the job's collective log (engines/runtime.py): on from the job's first
line to its last. `uninstall()` takes the kernels out again (the overhead benchmark only).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d_api
from torch.utils._python_dispatch import _disable_current_modes

from labkit.engines.meters.stream_mark import StreamMark
from labkit.layout.wire import WIRE


def _nb(t) -> int:
    return t.numel() * t.element_size()


def _first(ts):
    while isinstance(ts, (list, tuple)):
        ts = ts[0] if ts else None
    return ts


def _total(ts) -> int:
    if isinstance(ts, (list, tuple)):
        return sum(_total(t) for t in ts)
    return _nb(ts)


# c10d op -> (our op name, argument holding the tensor(s), how B is read, peer/root argument)
# B: 'sum' of that argument's bytes, or 'n*' that many bytes times the group size.
_C10D = {
    "allreduce_": ("all_reduce", "tensors", "sum", None),
    "allreduce_coalesced_": ("all_reduce", "tensors", "sum", None),
    "_allgather_base_": ("all_gather", "output_tensor", "sum", None),
    "allgather_": ("all_gather", "input_tensors", "n*", None),
    "allgather_coalesced_": ("all_gather", "input_list", "n*", None),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", "sum", None),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "sum", None),
    "reduce_scatter_": ("reduce_scatter", "output_tensors", "n*", None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "sum", None),
    "alltoall_base_": ("all_to_all", "input", "sum", None),
    "alltoall_": ("all_to_all", "input_tensors", "sum", None),
    "broadcast_": ("broadcast", "tensors", "sum", "root_rank"),
    "reduce_": ("reduce", "tensors", "sum", "root_rank"),
    "scatter_": ("scatter", "output_tensors", "n*", "root_rank"),
    "gather_": ("gather", "input_tensors", "n*", "root_rank"),
    "send": ("send", "tensors", "sum", "dst"),
    "recv_": ("recv", "tensors", "sum", "src"),
    "recv_any_source_": ("recv", "tensors", "sum", None),
    "barrier": ("barrier", None, None, None),
    "monitored_barrier_": ("barrier", None, None, None),
}


class CommMeter:
    """Collects CommEvents for one run on one rank. `CommMeter.current` is the active one
    (a class attribute, not a thread-local: DDP's reducer may issue from autograd threads)."""

    current: CommMeter | None = None

    def __init__(self, dims_by_ranks: dict[tuple[int, ...], str], clock=time.perf_counter):
        self.dims_by_ranks = dims_by_ranks  # group ranks -> mesh dim name ('dp', 'cp-dp', ...)
        self.clock = clock
        self.events: list[dict] = []
        self.phase = "setup"
        self.step = -1
        self._seq: dict[str, int] = {}
        self._pending: list[tuple[object, dict]] = []  # works with no future, and CUDA ones: polled
        self._lock = threading.Lock()

    def __enter__(self):
        install()
        CommMeter.current = self
        return self

    def __exit__(self, *exc):
        self.sweep()
        CommMeter.current = None

    # -- recording ----------------------------------------------------------------------------
    def begin(self, op: str, pg, tensor, payload: int, peer: int | None = None, root: bool = True) -> dict:
        # Runs once per collective on the rank's critical path: kept to plain lookups (no
        # world-size query unless the group is not a mesh group, dtype names cached).
        ranks = _ranks_of(pg)
        n = len(ranks)
        name = pg.group_name
        with self._lock:
            seq = self._seq.get(name, 0)
            self._seq[name] = seq + 1
        wire = WIRE[op](payload, n)
        if op == "scatter" and not root or op == "gather" and root:
            wire = 0.0
        dim = self.dims_by_ranks.get(ranks)
        if dim is None:
            dim = "world" if n == dist.get_world_size() else "other"
        ev = {
            "op": op,
            "dim": dim,
            "group": list(ranks),
            "numel": tensor.numel() if tensor is not None else 0,
            "dtype": _dtype_name(tensor.dtype) if tensor is not None else "",
            "shape": list(tensor.shape) if tensor is not None else [],
            "payload_bytes": int(payload),
            "wire_bytes": float(wire),
            "seq": seq,
            "pg": name,
            "peer": peer,
            "phase": self.phase,
            "step": self.step,
            "start": self.clock(),
            "end": None,
        }
        if self._pending:
            self.sweep()
        self.events.append(ev)
        return ev

    def end(self, ev: dict) -> None:
        if ev["end"] is None:
            ev["end"] = self.clock()

    def watch(self, work, ev: dict, on_device: bool = False) -> None:
        """Stamp `ev` when the op's Work completes: from its future's callback, or, for ops on
        CUDA tensors (on_device) and works without a future, when a sweep finds it completed.
        A CUDA future completes when the op is enqueued, and its callbacks run on a side stream
        that records every output on it (recordStream semantics, which PyTorch's NCCL backend
        avoids by default: TORCH_NCCL_AVOID_RECORD_STREAMS); Work.is_completed() reads the
        GPU's progress instead, so a hung op stays open in the log on NCCL as on gloo."""
        if work is None:
            self.end(ev)
            return
        if not on_device:
            try:
                work.get_future().add_done_callback(lambda f: self._done(ev, f))
                return
            except Exception:  # e.g. gloo's reduce-scatter has no future: poll it
                pass
        with self._lock:  # the Lab's poll sweeps from another thread
            self._pending.append((work, ev))

    def _done(self, ev: dict, fut) -> None:
        try:
            fut.value()
        except Exception as e:  # the op failed: it was never left
            ev["error"] = (str(e).splitlines() or [""])[0][:300]
            return
        self.end(ev)

    def sweep(self) -> None:
        """Stamp the polled works that have completed since the last look."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
        still = []
        for work, ev in pending:
            if work.is_completed():
                try:
                    ok = work.is_success()
                except Exception:
                    ok = True
                if ok:
                    self.end(ev)
                else:
                    ev["error"] = "failed"
            else:
                still.append((work, ev))
        with self._lock:
            self._pending[:0] = still

    def open_events(self) -> list[dict]:
        """Ops entered and not (yet) left: what a hung rank is waiting in."""
        self.sweep()
        return [e for e in self.events if e["end"] is None]

    def group_counts(self) -> dict[str, list]:
        """pg name -> [ops entered on it so far, its ranks]: how far this rank got in each group."""
        with self._lock:
            return {name: [n, list(_ranks_cache.get(name, ()))] for name, n in self._seq.items()}


_ranks_cache: dict[str, tuple[int, ...]] = {}


def _ranks_of(pg) -> tuple[int, ...]:
    name = pg.group_name
    if name not in _ranks_cache:
        _ranks_cache[name] = tuple(dist.get_process_group_ranks(pg))
    return _ranks_cache[name]


def forget_groups() -> None:
    """Forget cached group ranks (after the world was rebuilt: names are counters and get reused)."""
    _ranks_cache.clear()


_dtype_names: dict = {}


def _dtype_name(dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).replace("torch.", "")
    return name


def _reader(op, name: str | None):
    """A function (args, kwargs) -> the argument `name` of `op`, by its position in the schema
    (found once, not per call: the kernel below runs on every collective)."""
    if name is None:
        return lambda args, kwargs: None
    i = [a.name for a in op._schema.arguments].index(name)
    return lambda args, kwargs: args[i] if i < len(args) else kwargs[name]


def _c10d_kernel(name: str):
    op = getattr(torch.ops.c10d, name).default
    our, tensor_arg, rule, peer_arg = _C10D[name]
    read_pg, read_tensors, read_peer = _reader(op, "process_group"), _reader(op, tensor_arg), _reader(op, peer_arg)
    redispatch = op._handle.redispatch_boxed
    backend_select = torch._C.DispatchKey.BackendSelect
    unbox_pg, unbox_work = dist.ProcessGroup.unbox, torch._C._distributed_c10d.Work.unbox
    p2p = our in ("send", "recv")

    def kernel(keyset, *args, **kwargs):
        below = keyset.remove(backend_select)
        meter = CommMeter.current
        if meter is None:
            return redispatch(below, *args, **kwargs)
        pg = unbox_pg(read_pg(args, kwargs))
        if tensor_arg is None:
            tensor, payload = None, 0
        else:
            ts = read_tensors(args, kwargs)
            tensor = _first(ts)
            payload = _total(ts) * (pg.size() if rule == "n*" else 1)  # n*: one chunk of the full tensor
        peer, root = None, True
        if peer_arg is not None:
            local = read_peer(args, kwargs)
            peer = _ranks_of(pg)[local]
            root = pg.rank() == local
        ev = meter.begin(our, pg, tensor, payload, peer if p2p else None, root)
        out = redispatch(below, *args, **kwargs)
        waiting = getattr(_caller, "events", None)
        on_device = tensor is not None and tensor.is_cuda
        if waiting is not None and not on_device:
            waiting.append(ev)  # a blocking Python call issued it: its return is the end (_blocking)
            return out
        work = out[-1] if isinstance(out, tuple) else out
        # a CUDA op with no Work (a blocking NCCL collective: it ran on this stream, stream_mark.py) ends when the
        # GPU has run it; one with a Work may run on a side stream that this stream has not waited for yet, so
        # a mark here could complete first: its Work is polled (`watch`)
        if on_device and work is None and not torch.cuda.is_current_stream_capturing():
            work = StreamMark.after(tensor)
        elif work is not None:
            work = unbox_work(work)
        meter.watch(work, ev, on_device)
        return out

    return kernel


_LIBS: list = []  # the registrations live as long as these Library objects


_caller = threading.local()
"""`events`: the ops a blocking torch.distributed call of this thread has issued so far (None
outside one): the kernel leaves their end to the call's return instead of a future callback."""

BLOCKING = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
)
"""torch.distributed's calls that wait for their op unless async_op=True (send and recv always)."""

_UNWRAPPED: dict[str, object] = {}


def _blocking(fn):
    """fn, its ops stamped 'left' when it returns. A gloo future's callback runs in gloo's thread
    and takes the GIL from the rank's own thread once per op: ~100 us a collective on this 2-core
    machine (benchmarks/RESULTS.md, the collective log), 6% of a TP step with 21 of them. A
    blocking call has waited when it returns, so its return is the ops' end, on the caller's clock."""
    at = next((i for i, name in enumerate(inspect.signature(fn).parameters) if name == "async_op"), None)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        asynchronous = kwargs.get("async_op", args[at] if at is not None and at < len(args) else False)
        meter = CommMeter.current
        if meter is None or asynchronous or getattr(_caller, "events", None) is not None:
            return fn(*args, **kwargs)
        _caller.events = []
        try:
            out = fn(*args, **kwargs)
        except BaseException:  # a failed op is never 'left' (the module docstring)
            _caller.events = None
            raise
        events, _caller.events = _caller.events, None
        for ev in events:
            meter.end(ev)
        return out

    return call


@contextlib.contextmanager
def unlogged():
    """Collectives issued inside are neither in the collective log nor in the audit beside it (the
    lab's own control traffic: engines/mesh.py `Mesh.agree`)."""
    meter, CommMeter.current = CommMeter.current, None
    try:
        with _disable_current_modes():  # the audit's mode, if one is on
            yield
    finally:
        CommMeter.current = meter


def install() -> None:
    """Register the metering kernels once per process (idempotent; a no-op pass-through when no
    meter is active), and wrap torch.distributed's blocking calls (`_blocking`)."""
    if _LIBS:
        return
    c10d = torch.library.Library("c10d", "IMPL")
    for name in _C10D:
        if hasattr(torch.ops.c10d, name):
            c10d.impl(name, _c10d_kernel(name), "BackendSelect", with_keyset=True)
    _LIBS.append(c10d)
    for name in BLOCKING:
        original = getattr(c10d_api, name)
        _UNWRAPPED[name] = original
        wrapped = _blocking(original)
        setattr(c10d_api, name, wrapped)
        setattr(dist, name, wrapped)  # torch.distributed re-exports the same functions


def uninstall() -> None:
    """Unregister the metering kernels and unwrap the calls (the overhead benchmark measures
    steps without them)."""
    while _LIBS:
        _LIBS.pop()._destroy()
    for name, original in _UNWRAPPED.items():
        setattr(c10d_api, name, original)
        setattr(dist, name, original)
    _UNWRAPPED.clear()
