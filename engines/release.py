"""Releasing a rank: cut its torch connections so that every rank waiting on it is freed at once.

The Lab calls `release(peers)` on each rank whose job is over (labkit/cluster/faults.py), with `peers`
the other engines' listening sockets (engines/sockets.py `listening()`); see engines/runtime.py
for why destroying the process groups alone is not enough. On NCCL it calls `release(peers,
abort=True)` on every live rank, its job running or not: a rank waiting in an NCCL collective waits
in a GPU kernel, which no socket reaches, and only aborting that rank's communicators ends it.
"""

from __future__ import annotations

import os
import socket

import psutil

from labkit.engines import process_group, runtime, sockets


def route(backend: str, alive: bool, abort: bool) -> str:
    """What `release` does on a rank: 'abort' its NCCL communicators, then cut its sockets (an NCCL
    world the Lab asked to abort, the job running or not); 'wait' (its job still runs: a gloo rank is
    freed by its peers' releases, and released once its job is over); 'sockets' (cut them)."""
    if abort and backend == "nccl":
        return "abort"
    return "wait" if alive else "sockets"


def release(peers: list | tuple = (), abort: bool = False) -> dict:
    """If this rank's job is over, cut it off from the other ranks: every rank still waiting on
    it in a collective gets a connection error at once instead of hanging. Returns the job's state.

    Destroying the process groups closes their connections only if nothing else holds them, and
    PyTorch's DDP does (torch 2.13: once a DistributedDataParallel was built on a gloo group, the
    group outlives destroy_process_group). So the TCP connections themselves are shut down:
    those accepted on this engine's own listeners, and those to `peers` (the other engines'
    listeners, from `sockets.listening()`). The controller's connections are neither, and stay up.

    On NCCL with `abort` (see `route`), first every communicator of this rank is aborted
    (`_abort_communicators`), from this request thread while the job's thread may sit in a kernel:
    ncclCommAbort ends the rank's in-flight kernels, so that thread returns (with an error or a
    garbage value) and the job ends; destroying the groups instead waits for those kernels.

    Returns {"state": the job's state, "held": sockets still listening after the groups were
    destroyed, "route": what was done}: held nonzero means torch still holds some group (its gloo
    listeners cannot be shut without aborting the process), so the Lab replaces this engine rather
    than leak its ports."""
    job = runtime.current_job()
    how = route(runtime.current().backend if runtime.in_world() else "", job.alive, abort)
    if how == "wait":
        return {"state": job.state, "held": 0, "route": how}
    if how == "abort":
        _abort_communicators()
    mine = {port for _, port in sockets.listening()}
    process_group.shutdown_distributed()
    targets = {(ip, port) for ip, port in peers}
    wildcard = {port for ip, port in peers if ip in ("0.0.0.0", "::")}
    for c in psutil.Process().net_connections("inet"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        far = (sockets.plain_ip(c.raddr.ip), c.raddr.port)
        if c.laddr.port in mine or far in targets or far[1] in wildcard:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    return {"state": job.state, "held": len(sockets.listening()), "route": how}


def _abort_communicators() -> None:
    """Abort every process group of this rank and forget them, as a destroy would: torch's
    `_abort_process_group()` (read in torch 2.13's distributed_c10d.py: each group's `abort()`, the
    NCCL ones inside one ncclGroupStart/End so that two communicators' aborts cannot wait on each
    other, pytorch#119797). Its docstring asks for TORCH_NCCL_ASYNC_ERROR_HANDLING=0 lest the
    watchdog abort too; the engines run 2 (engines/process_group.py), so an abort that finds the
    watchdog was first may fail: caught, and the destroy in `release` follows."""
    import torch.distributed as dist  # engines only

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:  # the watchdog aborted first, or torch's groups are half gone
            pass
