"""What one engine process is: its rank, its process group, and the job it is running.

The Lab calls these functions on every engine (through ipyparallel, which this module never
imports). Work runs in a job thread, not in the engine's request loop, so the engine keeps
answering while a step is under way: the Lab polls it for per-step progress, reads the
collective log of a rank that is stuck in a collective, and asks it to cancel.

The module keeps the one piece of per-process state an engine has (`_state`): which rank it
is, and the current job. Parallel layouts keep none here; they live in the Mesh.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field


@dataclass
class Runtime:
    rank: int
    world_size: int
    backend: str
    device: str          # 'cpu' or 'cuda:N'
    host: str
    timeout_s: float
    generation: int      # how many times the process group has been (re)built
    clock_offset: float = 0.0   # add to this host's perf_counter to get rank 0's clock


class Cancelled(Exception):
    """Raised inside a job when the Lab asked it to stop."""


@dataclass
class Job:
    thread: threading.Thread | None = None
    state: str = "idle"          # idle | running | done | error | cancelled
    result: object = None
    error: str = ""
    progress: list = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0
    comm_meter: object = None    # the active CommMeter, for the collective log


class _State:
    runtime: Runtime | None = None
    listener: socket.socket | None = None
    job: Job = Job()


_state = _State()


# -- identity and rendezvous ----------------------------------------------------------------
def engine_info() -> dict:
    """Host, pid, address and GPUs of this engine (before it has a rank)."""
    import torch

    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "127.0.0.1"
    return {"host": host, "pid": os.getpid(), "addr": addr,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "python": sys.executable}


def open_rendezvous(bind: str) -> int:
    """Rank 0: listen on `bind` (127.0.0.1 for a local cluster) on a port the OS picks as free.

    The socket is handed to the TCPStore (master_listen_fd), so the store never listens on
    another address and no port is guessed (two Labs on one machine cannot collide).
    """
    if _state.listener is not None:
        _state.listener.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((bind, 0))
    s.listen(256)
    _state.listener = s
    return s.getsockname()[1]


def init_distributed(rank: int, world_size: int, addr: str, port: int, backend: str, device: str,
                     timeout_s: float, generation: int, threads: int, loopback: bool) -> dict:
    """Join the process group (tearing down an old one first). Returns this rank's Runtime."""
    import torch
    import torch.distributed as dist

    from labkit.engines.mesh import Mesh
    from labkit.engines.meters import comm

    shutdown_distributed()
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # gloo's own connections stay on 127.0.0.1
    torch.set_num_threads(max(1, threads))
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        fd = _state.listener.detach()
        _state.listener = None
        store = dist.TCPStore(addr, port, world_size, True, timeout, master_listen_fd=fd,
                              wait_for_workers=False, use_libuv=True)
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=torch.device(device) if backend == "nccl" else None)
    Mesh.forget_groups()
    comm.install()
    _state.runtime = Runtime(rank, world_size, backend, device, socket.gethostname(), timeout_s, generation)
    _state.runtime.clock_offset = _clock_offset()
    return _state.runtime.__dict__.copy()


def _clock_offset() -> float:
    """Offset of this host's perf_counter from rank 0's, from a barrier handshake (0 on one host)."""
    import torch
    import torch.distributed as dist

    rt = _state.runtime
    hosts = [None] * rt.world_size
    dist.all_gather_object(hosts, rt.host)
    if len(set(hosts)) == 1:
        return 0.0
    dist.barrier()
    t = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t) - time.perf_counter()


def shutdown_distributed() -> None:
    import torch.distributed as dist

    from labkit.engines.mesh import Mesh

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    Mesh.forget_groups()
    _state.runtime = None


def current() -> Runtime:
    if _state.runtime is None:
        raise RuntimeError("this engine has no process group yet: the Lab sets it up (Lab.__init__)")
    return _state.runtime


# -- jobs -----------------------------------------------------------------------------------
def start(fn, *args, **kwargs) -> bool:
    """Run fn(*args, **kwargs) in the job thread. Refuses if a job is still running."""
    job = _state.job
    if job.thread is not None and job.thread.is_alive():
        raise RuntimeError("a job is still running on this engine; cancel it or wait for it")
    job = Job(started=time.time())
    _state.job = job

    def body():
        try:
            job.result = fn(*args, **kwargs)
            job.state = "done"
        except Cancelled:
            job.state = "cancelled"
        except BaseException as e:   # noqa: BLE001 - everything goes back to the Lab
            job.error = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            job.state = "error"

    job.state = "running"
    job.thread = threading.Thread(target=body, name="labkit-job", daemon=True)
    job.thread.start()
    return True


def poll(since: int = 0, log_tail: int = 0) -> dict:
    """State of the job, the progress records after index `since`, and (if asked) the last
    `log_tail` collective-log entries with any entered-but-not-left ops."""
    job = _state.job
    out = {"state": job.state, "progress": job.progress[since:], "error": job.error}
    meter = job.comm_meter
    if log_tail and meter is not None:
        out["log"] = [dict(e) for e in meter.events[-log_tail:]]
        out["open"] = [dict(e) for e in meter.open_events()]
    return out


def result():
    """The finished job's return value (plain data)."""
    job = _state.job
    if job.state != "done":
        raise RuntimeError(f"no result: the job is {job.state}")
    out, job.result = job.result, None
    return out


def cancel() -> None:
    _state.job.cancel.set()


def progress(**fields) -> None:
    """Called by engine code: one progress record (e.g. step and loss) for the Lab to show."""
    _state.job.progress.append(fields)


def check_cancelled() -> None:
    """Called by engine code between steps and microbatches."""
    if _state.job.cancel.is_set():
        raise Cancelled()


def attach_comm_meter(meter) -> None:
    _state.job.comm_meter = meter


def call_pickled(blob: bytes, *args, **kwargs):
    """Lab.apply's body: fn(*args, **kwargs) on this rank with the process group ready
    (fn arrives pickled by value, so it may come from a notebook or a test module)."""
    import cloudpickle

    current()
    return cloudpickle.loads(blob)(*args, **kwargs)
