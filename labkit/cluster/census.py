"""Who holds what on this machine: every Lab's kernel, user, engines, cores, GPUs and memory (the
teacher's view of a classroom server; `labkit who` prints it).

Every Lab that starts a cluster starts a watchdog whose command line names its kernel's pid and the
Lab's token (labkit/cluster/watchdog.py), and every process of the Lab carries that token in its
environment (labkit/cluster/launchers.py: TAG). A token is no secret (it is on the watchdog's command
line), so a process counts in a Lab only when it runs as the Lab's user, the user of its kernel: another
user's process carrying the token (a `labkit-engine` of student B's with A's tag) is not A's, and a
watchdog that is not its kernel's user's names no Lab. Command lines and parents are readable by every user;
another user's environment, memory maps and network namespace only by root, so the teacher runs
`sudo labkit who` to see every student's Labs whole (without root, another user's Lab shows the
processes below its kernel, and its memory as RSS).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import psutil

from labkit.cluster import gpus
from labkit.cluster.forked import ENGINE_NAME, MODULE
from labkit.cluster.share import ranges
from labkit.cluster.watchdog import TAG
from labkit.config.table import Rows

MIB = 2**20
WATCHDOG = os.path.join("labkit", "cluster", "watchdog.py")


def labs() -> Rows:
    """One row per Lab on this machine: user, kernel (pid), engines, cores (the union of its
    engines' CPU affinity), gpus (the GPUs its processes hold, from NVML or nvidia-smi, with the
    memory each holds there), memory (its processes' PSS, or RSS where PSS cannot be read),
    netns (its engines' network namespace, where readable: a classroom's spawner gives each
    student one), processes."""
    held = gpu_processes()
    rows = Rows()
    for kernel, token in watchdogs():
        procs = members(kernel, token)
        engines = [p for p in procs if role(p) == "engine"]
        cores, netns = set(), set()
        for p in engines:
            try:
                cores |= set(p.cpu_affinity())
                netns.add(os.readlink(f"/proc/{p.pid}/ns/net"))  # root only, for another user's process
            except (psutil.Error, OSError):
                pass
        memory, pss = 0, True
        for p in [*live_processes([kernel]), *procs]:  # the kernel's own memory is the student's too
            try:
                memory += p.memory_full_info().pss
            except psutil.AccessDenied:  # another user's memory map: RSS is what can be read
                pss = False
                memory += _rss(p)
            except psutil.NoSuchProcess:
                pass
        on_gpus = {}
        for pid in [kernel, *(p.pid for p in procs)]:
            for uuid, used in held.get(pid, []):
                on_gpus[uuid] = on_gpus.get(uuid, 0) + used
        rows.append(
            {
                "user": _user(kernel),
                "kernel": kernel,
                "engines": len(engines),
                "engine pids": " ".join(str(p.pid) for p in engines),
                "cores": ranges(cores) if cores else "?",
                "gpus": ", ".join(f"{u[:12]} {b / MIB:,.0f} MiB" for u, b in sorted(on_gpus.items())) or "none",
                "memory MiB": round(memory / MIB),
                "memory is": "PSS" if pss else "RSS (run as root for PSS)",
                "netns": ", ".join(sorted(netns)) or "?",
                "processes": len(procs),
            }
        )
    return Rows(sorted(rows, key=lambda r: (r["user"], r["kernel"])))


def watchdogs() -> list[tuple[int, str]]:
    """(kernel pid, Lab token) of every Lab's watchdog on this machine (`python -I .../watchdog.py PID TOKEN`)."""
    out = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        where = [k for k, a in enumerate(cmd) if a.endswith(WATCHDOG)]
        if where and len(cmd) >= where[0] + 3 and cmd[where[0] + 1].isdigit():
            kernel = int(cmd[where[0] + 1])
            if p.info["uids"] and p.info["uids"].real == _uid(kernel):  # a Lab's watchdog runs as its kernel
                out.append((kernel, cmd[where[0] + 2]))
    return out


def members(kernel: int, token: str) -> list[psutil.Process]:
    """The Lab's processes: those tagged with its token, and, where a process's environment cannot
    be read (another user's, without root), the ipyparallel processes below its kernel."""
    found = {}
    unread = set()
    owner = _uid(kernel)
    for p in psutil.process_iter(["uids"]):
        if not p.info["uids"] or p.info["uids"].real != owner:  # the Lab's user's processes only
            continue
        try:
            if p.environ().get(TAG) == token:
                found[p.pid] = p
        except (psutil.AccessDenied, psutil.ZombieProcess):
            unread.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    try:
        below = psutil.Process(kernel).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    # a kernel may run several Labs: a readable tag says whose a process is
    for p in below:
        if p.pid in unread and role(p) in ("engine", "controller"):
            found.setdefault(p.pid, p)
    return list(found.values())


def role(p: psutil.Process) -> str:
    """'engine', 'engine set', 'controller' or 'other', from the command line ipyparallel's launchers
    give; a local Lab's engines share theirs with the process they were forked from (the engine set,
    labkit/cluster/forked.py), and carry its ENGINE_NAME."""
    try:
        cmd = p.cmdline()
        if MODULE in cmd:
            return "engine" if p.name() == ENGINE_NAME else "engine set"
    except psutil.Error:
        return "gone"
    if "ipyparallel.engine" in cmd:
        return "engine"
    if "ipyparallel.controller" in cmd:
        return "controller"
    return "other"


def gpu_processes() -> dict[int, list[tuple[str, int]]]:
    """pid -> [(GPU UUID, bytes it holds there)], from NVML (nvidia-ml-py) or nvidia-smi; {} without GPUs."""
    out: dict[int, list[tuple[str, int]]] = {}
    pynvml = gpus.pynvml  # nvidia-ml-py where installed (optional, labkit/cluster/gpus.py), else None
    try:
        pynvml.nvmlInit()
        for k in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(k)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = uuid if isinstance(uuid, str) else uuid.decode()
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                out.setdefault(proc.pid, []).append((uuid, proc.usedGpuMemory or 0))
        return out
    except Exception:  # no nvidia-ml-py (None), or no driver it can talk to: nvidia-smi may still answer
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return out
    got = subprocess.run(
        [smi, "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for line in got.stdout.strip().splitlines() if got.returncode == 0 else []:
        uuid, pid, used = (f.strip() for f in line.split(","))
        if pid.isdigit():
            out.setdefault(int(pid), []).append((uuid, int(float(used or 0)) * MIB))
    return out


def table(rows: Rows) -> str:
    """The rows as text, one Lab a line (what `labkit who` prints)."""
    if not rows:
        return "no Lab runs on this machine"
    keys = [k for k in rows[0] if k != "memory is"]
    width = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(width[k]) for k in keys)]
    lines += ["  ".join(str(r[k]).ljust(width[k]) for k in keys) for r in rows]
    if any(r["memory is"] != "PSS" for r in rows):
        lines.append("memory: RSS where another user's PSS cannot be read (run as root: sudo labkit who)")
    return "\n".join(lines)


def _user(pid: int) -> str:
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):  # gone, or a uid with no name
        return "?"


def _uid(pid: int) -> int | None:
    """The real uid of `pid`; None where it is gone."""
    try:
        return psutil.Process(pid).uids().real
    except psutil.Error:
        return None


def live_processes(pids) -> list[psutil.Process]:
    """The processes of `pids` still alive (a pid gone between its listing and here is left out)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _rss(p: psutil.Process) -> int:
    try:
        return p.memory_info().rss
    except psutil.Error:
        return 0
