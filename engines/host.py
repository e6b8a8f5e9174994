"""What an engine is before it has a rank: its host, pid, addresses, GPUs (by physical identity)
and CPUs, which the Lab reads to lay out the world (labkit/cluster/world.py); and where it is: the address
and interface it reaches the controller through (the cluster's network, on which its host's ranks
should listen and talk), the machine and pid namespace (whether the Lab can watch its pid), its
rank in the launcher that started it (mpiexec's, srun's).

torch is imported inside `engine_info`: the notebook imports this module only to name the function
it sends to the engines, and never loads torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading

import psutil

from labkit.engines import runtime, sockets

LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
"""Where mpiexec (Open MPI, MPICH) and srun tell a process its rank among those they started."""


def end_at_once_on_sigterm() -> None:
    """SIGTERM (a Lab's close, ipcluster stop, the watchdog) ends this engine at once: its output flushed,
    then os._exit, past ipyparallel's stop and Python's teardown of a process with torch loaded (0.7 s
    of CPU an engine here; a 4-engine Lab's close: 3.1 s before, 0.2 s now, benchmarks/lab_start.py).
    Nothing an engine holds needs its finalizers: sockets, gloo's and NCCL's communicators and the GPU
    context end with the process, and a result the Lab still wanted is gone either way once it asks the
    engine to stop. In the engine's main thread only (signal's rule); elsewhere the engine keeps
    ipyparallel's handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    # ipyparallel's own SIGTERM handling ends the engine with 0 too
    signal.signal(signal.SIGTERM, lambda signum, frame: exit_now(0))


def exit_now(code: int) -> None:
    """Flush the process's own streams (the launcher's log files) and os._exit(code): no teardown.
    Not ipykernel's forwarded streams, whose flush waits on its IO thread and whose client has gone."""
    for stream in (sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def engine_info(toward: str | None = None) -> dict:
    """host, pid, addr (an address of this host others can reach, if it has one), addrs (all of
    its non-loopback IPv4 addresses), gpus (how many this engine sees), gpu_uuids (which physical
    GPUs those are), nccl (its NCCL's version, '' without GPUs), cpus (this host's), cores, cpu_quota
    and cpu_limit (what this process may use of them: `cpu_share`), python; with
    `toward` (the controller's address) also route_addr and route_ifname, the local address and
    interface that reach it; boot_id and pid_ns (one machine, one pid namespace: the Lab can watch
    the engine's pid); launcher_rank."""
    import torch  # engines only (see the module docstring)

    end_at_once_on_sigterm()
    if not runtime.in_world():  # before torch listens on anything: the engine's own sockets
        sockets.remember_engine_listeners()
    host = socket.gethostname()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    addrs = _interface_addresses()
    return {
        "host": host,
        "pid": os.getpid(),
        "addr": _address(host, addrs),
        "addrs": addrs,
        "gpus": gpus,
        "gpu_uuids": [_gpu_uuid(torch, k) for k in range(gpus)],
        "nccl": _nccl(torch) if gpus else "",
        "cpus": os.cpu_count() or 1,
        **cpu_share(),
        "python": sys.executable,
        **route(toward),
        **machine(),
        "launcher_rank": next((int(os.environ[k]) for k in LAUNCHER_RANKS if k in os.environ), None),
    }


def cpu_share() -> dict:
    """What of this host's CPUs this process may use (labkit/cluster/share.py states the rule that
    reads it): cores, the CPUs its affinity allows (inherited from the kernel, which a classroom's
    spawner pins per student); cpu_quota, the CPUs' worth of time its cgroup allows (cgroup v2
    cpu.max, v1 cpu.cfs_quota_us), None without one; cpu_limit, JupyterHub's CPU_LIMIT (a
    spawner's promise, enforced or not), None if unset. No torch: the Lab calls it for itself."""
    try:
        limit = float(os.environ["CPU_LIMIT"]) or None
    except (KeyError, ValueError):
        limit = None
    return {"cores": sorted(os.sched_getaffinity(0)), "cpu_quota": _cgroup_quota(), "cpu_limit": limit}


def _cgroup_quota() -> float | None:
    """CPUs' worth of time per period this process's cgroup allows (its own cgroup's limit; a
    parent's tighter one is not read), None when unlimited or unknown."""
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: "max 100000" or "200000 100000"
            quota, _, period = _read(f"/sys/fs/cgroup{path}/cpu.max").partition(" ")
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller: -1 is unlimited
            base = f"/sys/fs/cgroup/{controllers}{path}"
            quota, period = _read(f"{base}/cpu.cfs_quota_us"), _read(f"{base}/cpu.cfs_period_us")
        else:
            continue
        try:
            if float(quota) > 0 and float(period) > 0:
                return float(quota) / float(period)
        except ValueError:  # "max", or no such file
            pass
    return None


def machine() -> dict:
    """boot_id (this kernel's boot) and pid_ns (this process's pid namespace): two processes that
    report the same both see each other's pids. No torch: the Lab calls it for itself."""
    return {"boot_id": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": _link("/proc/self/ns/pid")}


def route(toward: str | None) -> dict:
    """The local address (and its interface) this host uses to reach `toward`: what a UDP
    connect() picks from the routing table, no packet sent. {} without `toward`."""
    if not toward:
        return {}
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((toward, 9))
            addr = s.getsockname()[0]
    except OSError:
        return {}
    if addr.startswith("127."):
        return {"route_addr": addr, "route_ifname": "lo"}
    names = [
        name
        for name, found in psutil.net_if_addrs().items()
        for a in found
        if a.family == socket.AF_INET and a.address == addr
    ]
    return {"route_addr": addr, "route_ifname": names[0] if names else ""}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _address(host: str, addrs: list[str]) -> str:
    """The host name's address, unless it is a loopback one (Debian and Ubuntu map the host name
    to 127.0.1.1 in /etc/hosts): then the first address of an interface that is up, if any."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "127.0.0.1"
    if addr.startswith("127.") and addrs:
        return addrs[0]
    return addr


def _interface_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of the interfaces that are up."""
    stats = psutil.net_if_stats()
    return [
        a.address
        for name, found in psutil.net_if_addrs().items()
        if name in stats and stats[name].isup
        for a in found
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def _nccl(torch) -> str:
    """The version of the NCCL this process runs ('2.30.7'), '' where torch has none."""
    v = nccl_version()
    return ".".join(map(str, v)) if v else ""


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL this process has loaded, asked at run time (ncclGetVersion): an LD_PRELOAD or a
    newer nvidia-nccl wheel replaces torch's own, and torch.cuda.nccl.version() reports the one
    torch was built with, not this. None where no NCCL is loaded (a CPU build of torch)."""
    import torch  # engines only; loads libtorch_cuda and its NCCL, where there are

    if not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libnccl.so.2")  # the soname already loaded, if any
    except OSError:
        return None
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    c = code.value  # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9
    return (c // 10000, c // 100 % 100, c % 100) if c >= 20900 else (c // 1000, c // 100 % 10, c % 100)


def _gpu_uuid(torch, k: int) -> str:
    """The physical identity of visible GPU k ('' if this torch build cannot say)."""
    try:
        return str(torch.cuda.get_device_properties(k).uuid)
    except Exception:  # an older build or a driver without it: the Lab falls back to indices
        return ""
