"""This engine's place in the torch world: joining it (the rendezvous, the store, the process
group, the clock) and leaving it. The Lab calls these on every engine
(labkit/cluster/engine_set.py), once per world: at start-up and after a repair.

What the world is made of was decided in the notebook (labkit/cluster/world.py: backend, devices,
address, threads); this module carries it out on the engine and records the result as the
engine's Runtime (engines/runtime.py, where the job reads it). torch is imported inside the
functions: the notebook imports this module only to name the functions the Lab sends.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time

from labkit.engines import group_log, rendezvous, runtime

_listener: socket.socket | None = None
"""Rank 0's listening socket, from open_rendezvous until the store takes it."""
_store: object = None
"""This rank's TCPStore while it is in a world (on rank 0 it serves the others)."""


def open_rendezvous(bind: str) -> int:
    """Rank 0: listen on `bind` (127.0.0.1 for a local cluster) on a port the OS picks as free.

    The socket is handed to the TCPStore (master_listen_fd), so the store never listens on
    another address and no port is guessed (two Labs on one machine cannot collide).
    """
    global _listener
    if _listener is not None:
        _listener.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((bind, 0))
    s.listen(256)
    _listener = s
    return s.getsockname()[1]


def init_distributed(
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    backend: str,
    device: str,
    timeout_s: float,
    generation: int,
    threads: int,
    loopback: bool,
    env: dict | None = None,
    ifname: str | None = None,
    memory_fraction: float | None = None,
) -> dict:
    """Join the process group (tearing down an old one first). Returns this rank's Runtime.
    env: variables to set first (the notebook's NCCL_* and GLOO_SOCKET_IFNAME, labkit/cluster/world.py);
    ifname: the interface this host's ranks talk on (labkit/cluster/world.py), unless env names one;
    memory_fraction: the cap on this rank's share of its GPU (a classroom's shared GPUs)."""
    import torch  # engines only, like the comm meter that imports it
    import torch.distributed as dist

    from labkit.engines.meters import comm

    global _listener, _store
    if runtime.current_job().alive:
        raise RuntimeError("a job is still running on this engine; it must end before the process group is rebuilt")
    shutdown_distributed()
    os.environ.update(env or {})
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on 127.0.0.1
    elif ifname:  # gloo listens and connects on the cluster's network only, NCCL bootstraps there
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ[name] = (env or {}).get(name) or ifname
    # On a timeout NCCL's watchdog aborts the communicators and leaves the process alive (2:
    # CleanUpOnly; the default tears the process down), so the Lab can still read this rank's
    # logs and the next call rebuilds the groups. Read by ProcessGroupNCCL when a group is made.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    torch.set_num_threads(max(1, threads))
    sys.setswitchinterval(runtime.GIL_SWITCH_S)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        fd = _listener.detach()
        _listener = None
        store = dist.TCPStore(
            addr, port, world_size, True, timeout, master_listen_fd=fd, wait_for_workers=False, use_libuv=True
        )
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    _store = store
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        if memory_fraction:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, torch.device(device))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=torch.device(device) if backend == "nccl" else None,
    )
    comm.install()
    group_log.install(runtime.group_timeout)
    rt = runtime.Runtime(rank, world_size, backend, device, socket.gethostname(), timeout_s, generation)
    runtime.set_current(rt)
    rt.clock_offset = clock_offset()
    if rank == 0 and backend == "gloo":
        # Every rank's store client has connected by now (gloo's rendezvous read each rank's
        # address from the store), and gloo's later groups reuse those connections: the store,
        # which has no authentication, stops taking new ones. NCCL's communicator splits clone
        # the store (a new connection), so on NCCL it listens for as long as the world.
        rendezvous.seal(fd, (addr, port))
    return rt.__dict__.copy()


def clock_offset() -> float:
    """Offset of this host's perf_counter from rank 0's, from a barrier handshake (0 on one host)."""
    import torch  # engines only
    import torch.distributed as dist

    rt = runtime.current()
    hosts = [None] * rt.world_size
    dist.all_gather_object(hosts, rt.host)
    if len(set(hosts)) == 1:
        return 0.0
    dist.barrier()
    # on the rank's device: an NCCL-only world has no backend for CPU tensors
    t = torch.tensor([time.perf_counter()], dtype=torch.float64, device=rt.device)
    dist.broadcast(t, src=0)
    return float(t) - time.perf_counter()


def shutdown_distributed() -> None:
    """Destroy every process group of this rank (closing its connections) and forget them."""
    import torch.distributed as dist  # engines only, like the comm meter that imports torch

    from labkit.engines.mesh import Mesh
    from labkit.engines.meters import comm

    global _store
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    Mesh.forget_groups()
    comm.forget_groups()  # group names are reused by the next world: drop their cached ranks
    _store = None  # the TCPStore (and on rank 0 its listening socket) goes with it
    rendezvous.forget()
    runtime.set_current(None)
    # A gloo group closes its connections only when its last reference goes, and a finished
    # run's DDP keeps its groups in reference cycles (gradient hooks): collect them now, or the
    # peers of a released rank would go on waiting.
    gc.collect()
