"""How Labs share one machine (a classroom's students on one server): the rule, and its words.

    cores   A Lab's engines use the CPUs its kernel may run on: the kernel's CPU affinity, which
            its engines inherit and which a classroom's spawner sets per student
            (classroom/classroom_spawner.py), capped by a CPU quota where one is set (the
            cgroup's cpu.max, or JupyterHub's CPU_LIMIT). Each engine runs
            max(1, usable cores // the Lab's engines on that host) intra-op threads, so a Lab
            never runs more threads than its share has cores, whatever the machine has.
    GPUs    A Lab's engines use GPUs among those its kernel sees (CUDA_VISIBLE_DEVICES, which the
            spawner sets per student; every GPU where unset): gpus=None all of them, gpus=[i, ...]
            the i-th of them, gpus='auto' those with the most free memory among them
            (labkit/cluster/gpus.py); gpu_memory_fraction caps each rank's allocator on its GPU.

Each Lab shows its share in its repr (`Lab.share`); `labkit who` shows every Lab's on the machine
(labkit/cluster/census.py). Pure functions of what the engines report (engines/host.py: cpu_share).
"""

from __future__ import annotations

from labkit.config.table import Rows


def usable_cores(info: dict, default: int = 1) -> int:
    """How many CPUs an engine reporting `info` may use (the rule above): its affinity's cores,
    capped by its CPU quota and CPU_LIMIT, at least 1. Without `cores` (an older engine), its
    host's cpus, else `default`."""
    n = len(info.get("cores") or ()) or info.get("cpus") or default
    for cap in (info.get("cpu_quota"), info.get("cpu_limit")):
        if cap:
            n = min(n, max(1, int(cap)))  # 1.5 CPUs of quota run one thread at full speed, not two
    return max(1, n)


def ranges(ids) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (as taskset and cpuset write CPU lists)."""
    ids = sorted(set(ids))
    out, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)


def why_cores(info: dict) -> str:
    """What limits an engine's cores, in words: 'CPU affinity', 'cgroup quota 2.0', 'CPU_LIMIT 4'."""
    n_affinity = len(info.get("cores") or ()) or info.get("cpus") or 1
    for name, cap in (("cgroup quota", info.get("cpu_quota")), ("CPU_LIMIT", info.get("cpu_limit"))):
        if cap and max(1, int(cap)) < n_affinity:
            return f"{name} {cap:g}"
    return "CPU affinity" if info.get("cores") and len(info["cores"]) < (info.get("cpus") or 0) else "every CPU"


def share_rows(infos: list[dict], threads: list[int], devices: list[str], memory_fraction: float | None) -> Rows:
    """One row per host of a Lab: its engines' cores (which, how many usable, why), threads per
    engine, and GPUs (the ones they see, and each rank's cap)."""
    rows = Rows()
    for host in dict.fromkeys(i["host"] for i in infos):
        ranks = [r for r, i in enumerate(infos) if i["host"] == host]
        first = infos[ranks[0]]
        gpus = sorted({u for r in ranks for u in (infos[r].get("gpu_uuids") or [])})
        on_gpu = [r for r in ranks if devices[r].startswith("cuda")]
        rows.append(
            {
                "host": host,
                "engines": len(ranks),
                "cores": ranges(first.get("cores") or range(first.get("cpus") or 1)),
                "usable": usable_cores(first),
                "limited by": why_cores(first),
                "threads per engine": threads[ranks[0]],
                "gpus": ", ".join(g[:12] for g in gpus) or "none",
                "ranks on gpus": len(on_gpu),
                "gpu memory cap": f"{memory_fraction:.0%} per rank" if memory_fraction and on_gpu else "none",
            }
        )
    return rows


def describe(rows: Rows) -> str:
    """The share in one line, for the Lab's repr: 'cores 0-1 (CPU affinity): 1 thread x 2 engines'."""
    parts = []
    for row in rows:
        threads = f"{row['threads per engine']} thread(s) x {row['engines']} engines"
        text = f"cores {row['cores']} ({row['limited by']}): {threads}"
        if row["ranks on gpus"]:
            text += f"; gpus {row['gpus']}, cap {row['gpu memory cap']}"
        parts.append(text if len(rows) == 1 else f"{row['host']}: {text}")
    return "; ".join(parts)
