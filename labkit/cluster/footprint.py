"""What a Lab's processes hold in memory, per process: its role, and RSS, USS and PSS.

RSS counts every page a process maps, shared libraries included, so summing it over engines that
all map torch's libraries counts those pages once per engine. USS is what the process alone holds
(freed when it exits); PSS shares each shared page among the processes that map it, so a sum of
PSS is what the processes hold together: what a memory cgroup such as a Binder pod's (about 2 GB)
charges them, page cache aside. psutil reads all three from /proc/PID/smaps_rollup.
"""

from __future__ import annotations

import os

import psutil

from labkit.cluster import forked

MIB = 2**20


def _role(proc: psutil.Process, engines: set[int], controller: int | None) -> str:
    if proc.pid in engines:
        return "engine"
    if proc.pid == controller:
        return "controller"
    try:
        cmd = " ".join(proc.cmdline())
        parent = proc.ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    if parent in engines:
        return "nanny"  # ipyparallel's engine nanny is the engine's child process
    if controller is not None and parent == controller:
        return "controller child"  # its schedulers (unless threads) and the heart monitor
    if "labkit" in cmd and "watchdog" in cmd:
        return "watchdog"
    if forked.MODULE in cmd:
        return "engine set"  # the process a local Lab's engines were forked from (labkit/cluster/forked.py)
    return os.path.basename(cmd.split(" ")[0]) or "other"


def footprint(
    pids: list[int], engines: list[int], controller: int | None = None, kernel: int | None = None
) -> list[dict]:
    """One row per live process of `pids` (and the kernel's own, `kernel`): pid, role, rss, uss, pss (bytes)."""
    rows = []
    for pid in ([kernel] if kernel else []) + [p for p in pids if p != kernel]:
        try:
            proc = psutil.Process(pid)
            mem = proc.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = "kernel" if pid == kernel else _role(proc, set(engines), controller)
        rows.append({"pid": pid, "role": role, "rss": mem.rss, "uss": mem.uss, "pss": mem.pss})
    return rows


def by_role(rows: list[dict]) -> dict[str, dict]:
    """role -> {count, rss, uss, pss} summed, plus 'all' over every row."""
    out: dict[str, dict] = {}
    for r in rows:
        for key in (r["role"], "all"):
            acc = out.setdefault(key, {"count": 0, "rss": 0, "uss": 0, "pss": 0})
            acc["count"] += 1
            for k in ("rss", "uss", "pss"):
                acc[k] += r[k]
    return out


def table(rows: list[dict]) -> str:
    """The rows by role, in MiB, as text (GUIDE.md's numbers, "A Lab in a Binder tab", come from it)."""
    lines = [f"{'role':18s} {'n':>3s} {'RSS':>8s} {'USS':>8s} {'PSS':>8s}  (MiB)"]
    for role, acc in sorted(by_role(rows).items(), key=lambda kv: (kv[0] == "all", -kv[1]["pss"])):
        lines.append(
            f"{role:18s} {acc['count']:3d} {acc['rss'] / MIB:8.0f} {acc['uss'] / MIB:8.0f} {acc['pss'] / MIB:8.0f}"
        )
    return "\n".join(lines)
