"""What one engine process is: its rank, and the job it is running.

The Lab calls these functions on every engine (through ipyparallel, which this module never
imports); engines/process_group.py joins the engine to a torch world and records its rank here.
Work runs in a job thread, not in the engine's request loop, so the engine keeps answering while
a step is under way: the Lab polls it for per-step progress, reads the
collective log of a rank that is stuck in a collective, and asks it to cancel.

The collective log. Every job runs under one CommMeter (engines/meters/comm.py) from its
first line to its last, so each collective and point-to-point op the job issues — and each
process group it creates — is recorded when entered and when left, with its group and a
sequence number per group. That is what the Lab's hang diagnosis reads (labkit/cluster/diagnose.py);
a training run's report takes the slice of the same log that covers its steps.

Releasing a stuck rank. A thread blocked inside a gloo collective cannot be interrupted from
Python, and aborting the process group from another thread of the same process does not free
it (checked with torch 2.13). What does free it at once is a peer closing its connections:
when a rank whose job has ended cuts its connections to the other ranks, every rank waiting
on it gets "Connection closed by peer" within milliseconds. `release()` (engines/release.py)
does exactly that, and the Lab calls it on every rank whose job is over until nobody is left
waiting. A cycle of ranks that all wait on each other is freed by the process groups' own
timeout (set per job, slightly above the Lab's), or by replacing an engine.

The module keeps the one piece of per-process state an engine has (`_state`): which rank it
is and the current job. Parallel layouts keep none here; they live in the Mesh.
torch (and the comm meter, which imports it) is imported inside the functions: the notebook
imports this module only to name the functions the Lab sends, and never loads torch.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from labkit.engines import flight, group_log

PG_MARGIN_S = 2.0
"""A job's process groups time out this much later than the Lab gives up on the job, so the Lab
always reads the ranks' logs while they are still inside the hung op, and gloo then frees them."""

LATE_S = 5.0
"""How long a cancelled job waits for the stop its ranks agree on (the next step boundary, `stop_agreed`)
before a rank stops on its own at the next microbatch or wait (`check_cancelled`): a step longer than
this, or one stuck, still stops; its ranks then stop at different points and the Lab releases and
rebuilds (labkit/cluster/faults.py)."""

GIL_SWITCH_S = 1e-4
"""The engine's GIL switch interval (Python's default is 5 ms). A job thread that drops the GIL
(in every collective: the comm meter's kernel takes it back on the dispatch path, its done-callback
on gloo's thread) and wants it again waits until the thread that took it meanwhile (one of
ipyparallel's) yields it, up to the interval. With 4 ranks on 2 cores that cost ~0.9 ms per
collective at 5 ms and ~0.1 ms at 0.1 ms (benchmarks/RESULTS.md, 'profile'). Set when the engine
joins a world (engines/process_group.py)."""


@dataclass
class Runtime:
    rank: int
    world_size: int
    backend: str
    device: str  # 'cpu' or 'cuda:N'
    host: str
    timeout_s: float
    generation: int  # how many times the process group has been (re)built
    clock_offset: float = 0.0  # add to this host's perf_counter to get rank 0's clock


class Cancelled(Exception):
    """Raised inside a job when the Lab asked it to stop."""


@dataclass
class Job:
    thread: threading.Thread | None = None
    state: str = "idle"  # idle | running | done | error | cancelled
    result: object = None
    error: str = ""
    progress: list = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    cancelled_at: float | None = None  # time.monotonic() of the Lab's cancel
    agrees: bool = False  # its ranks agree where to stop (stop_agreed): check_cancelled waits for that first
    started: float = 0.0
    timeout_s: float | None = None
    comm_meter: object = None  # the job's CommMeter: its collective log

    @property
    def alive(self) -> bool:
        """Whether the job's thread still runs (its state says 'done' a moment before it ends)."""
        return self.thread is not None and self.thread.is_alive()


class _State:
    runtime: Runtime | None = None
    job: Job = Job()
    jobs: int = 0


_state = _State()


# -- the rank -------------------------------------------------------------------------------
def in_world() -> bool:
    """Whether this engine has joined a torch world (has a rank). engines/host.py says what it
    is before that."""
    return _state.runtime is not None


def set_current(rt: Runtime | None) -> None:
    """This engine's rank in the world it just joined, or None when it left it
    (engines/process_group.py)."""
    _state.runtime = rt


def current_job() -> Job:
    """The job this engine is running, or ran last."""
    return _state.job


def current() -> Runtime:
    if _state.runtime is None:
        raise RuntimeError("this engine has no process group yet: the Lab sets it up (Lab.__init__)")
    return _state.runtime


def process_groups() -> int:
    """How many process groups this rank holds (the soak test checks that it stays bounded)."""
    from torch.distributed import distributed_c10d as c10d  # engines only

    return len(c10d._world.pg_names)


# -- the job's process groups ----------------------------------------------------------------
def group_timeout() -> float | None:
    """Seconds a group created now should wait: the running job's timeout plus the margin."""
    job = _state.job
    if job.timeout_s is None or job.state != "running":
        return None
    return job.timeout_s + PG_MARGIN_S


def job_comm_meter():
    """The running job's collective log (a CommMeter), or None outside a job / with the log off."""
    job = _state.job
    if job.state == "running" and job.comm_meter is not None:
        return job.comm_meter
    return None


def use_log(log) -> None:
    """The rest of this job's collective log is `log`: a script's, fed by its own process
    (engines/script/log.py), whose collectives never pass through this engine's meter."""
    _state.job.comm_meter = log


def comm_log_off() -> None:
    """Run the rest of this job without the collective log, the meter's kernels unregistered
    (only the overhead benchmark does this: it compares step times with and without)."""
    from labkit.engines.meters import comm  # imports torch: engines only

    job = _state.job
    if job.comm_meter is not None:
        job.comm_meter.__exit__(None, None, None)
        job.comm_meter = None
    comm.uninstall()


# -- jobs -----------------------------------------------------------------------------------
def start(fn, args: tuple = (), kwargs: dict | None = None, timeout_s: float | None = None) -> int:
    """Run fn(*args, **kwargs) in the job thread, under a fresh collective log; the process
    groups time out `PG_MARGIN_S` after `timeout_s`. Refuses if a job is still running.
    Returns how many jobs this engine has started (the Lab's tests count them)."""
    from labkit.engines import device  # imports torch: engines only
    from labkit.engines.meters.comm import CommMeter

    if _state.job.alive:
        raise RuntimeError("a job is still running on this engine; cancel it or wait for it")
    kwargs = kwargs or {}
    job = Job(started=time.time(), timeout_s=timeout_s)
    if _state.runtime is not None and timeout_s is not None:
        group_log.set_timeouts(timeout_s + PG_MARGIN_S)
    job.comm_meter = CommMeter({})
    _state.job = job
    _state.jobs += 1

    where = _state.runtime.device if _state.runtime is not None else "cpu"

    def body():
        try:
            device.bind(where)  # CUDA's current device is per thread: this one starts on cuda:0
            with job.comm_meter:
                job.result = fn(*args, **kwargs)
            job.state = "done"
        except Cancelled:
            job.state = "cancelled"
        except BaseException as e:  # noqa: BLE001 - everything goes back to the Lab
            job.error = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            job.state = "error"

    job.state = "running"
    job.thread = threading.Thread(target=body, name="labkit-job", daemon=True)
    job.thread.start()
    return _state.jobs


def poll(since: int = 0, log_tail: int = 0) -> dict:
    """State of the job and the progress records after index `since`. With log_tail > 0 also
    the last `log_tail` collective-log entries, how far each of its groups got (`groups`:
    pg name -> [ops entered, ranks]), how many ops are open, the process groups this rank
    holds (`registry`: name -> ranks), on NCCL the ops the GPU has not completed (`gpu`: the
    flight recorder's, engines/flight.py; the log's ends are enqueue times there) and, while
    it runs, where the job thread is (`stack`)."""
    job = _state.job
    out = {"state": job.state, "progress": job.progress[since:], "error": job.error}
    if not log_tail:
        return out
    meter = job.comm_meter
    out["log"], out["groups"] = [], {}
    if meter is not None:
        meter.sweep()
        out["log"] = [dict(e) for e in meter.events[-log_tail:]]
        out["groups"] = meter.group_counts()
        out["open"] = len(meter.open_events())
    # a script's log (engines/script/log.py) knows its own process's groups and main thread: the job
    # thread only waits for that process, and the engine's groups are not the script's
    script = meter if hasattr(meter, "registry") else None
    out["registry"] = script.registry() if script is not None else group_registry()
    if (
        _state.runtime is not None and _state.runtime.backend == "nccl" and script is None
    ):  # what the GPU has not finished
        out["gpu"] = flight.gpu_ops()
    if script is not None:
        if script.stack():
            out["stack"] = script.stack()
    elif job.state == "running" and job.thread is not None:
        frame = sys._current_frames().get(job.thread.ident)
        if frame is not None:
            out["stack"] = "".join(traceback.format_stack(frame)[-4:])
    return out


def group_registry() -> dict[str, list[int]]:
    """Process groups this rank is a member of: name -> global ranks (torch's own bookkeeping)."""
    from torch.distributed import distributed_c10d as c10d  # engines only

    try:
        return {
            str(c10d._world.pg_names[pg]): sorted(ranks)
            for pg, ranks in c10d._world.pg_group_ranks.items()
            if pg in c10d._world.pg_names
        }
    except Exception:
        return {}


def result():
    """The finished job's return value (plain data)."""
    job = _state.job
    if job.state != "done":
        raise RuntimeError(f"no result: the job is {job.state}")
    out, job.result = job.result, None
    return out


def cancel() -> None:
    job = _state.job
    if job.cancelled_at is None:
        job.cancelled_at = time.monotonic()
    job.cancel.set()


def progress(**fields) -> None:
    """Called by engine code: one progress record (e.g. step and loss) for the Lab to show."""
    _state.job.progress.append(fields)


def check_cancelled() -> None:
    """Called by engine code between microbatches and while it waits for a device: stops this rank
    alone, so only once the stop its ranks agree on (`stop_agreed`, at the next step boundary) is
    LATE_S overdue — a step too long or stuck. A job with no step boundaries of its own (Lab.apply's,
    Lab.verify's) stops here at once."""
    job = _state.job
    if job.cancel.is_set() and (not job.agrees or time.monotonic() - job.cancelled_at >= LATE_S):
        raise Cancelled()


def stop_agreed(agree) -> None:
    """At a step boundary, on every rank of a layout: raise Cancelled on all of them together if the
    Lab cancelled any. `agree(flag) -> bool` asks the layout's ranks whether any of them says flag
    (engines/mesh.py `Mesh.agree`: one all-reduce of a flag, outside the collective log). A cancel
    reaches the ranks at different moments; stopping where each first sees it left some ranks inside
    the next step's collectives, waiting for peers that had stopped."""
    job = _state.job
    job.agrees = True
    if agree(job.cancel.is_set()):
        raise Cancelled()


def call_named(target: str, *args, **kwargs):
    """target ('module:function') imported here and called: the Lab names it, never imports it."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


def call_pickled(blob: bytes, *args, **kwargs):
    """Lab.apply's body: fn(*args, **kwargs) on this rank with the process group ready
    (fn arrives pickled by value, so it may come from a notebook or a test module)."""
    import cloudpickle  # heavy; only a Lab.apply needs it

    current()
    return cloudpickle.loads(blob)(*args, **kwargs)
