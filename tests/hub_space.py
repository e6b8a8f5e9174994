"""Student B's attacks on what students share besides the network, for tests/test_classroom_hub.py:
the compile cache in /tmp, /proc (A's sockets, command lines, the Lab's tag and so its census), the
host's services, the cores; and what B leaves to outlive its server's stop. Each function drives
B's kernel (hub_attacks.py's functions, sent there by the test) and A's, and judges by the effect
on A or on the machine, as the test's other attacks do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import psutil
from hub_probes import cgroup_dirs, holders, namespaces, shm_of, temp_files_of
from hub_tools import Hub, Kernel, Students

from labkit.cluster import census
from labkit.cluster.watchdog import TAG

COMPILE = """
def _compiled_with():
    import ctypes, os, tempfile
    from torch._inductor import codecache
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    dirs = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return {"planted": bool(libc.getenv(b"PLANTED_BY_B")), "headers": codecache._HEADER_DIR, **dirs}
# the first compile builds torch's precompiled header (one g++ run) on the student's one core
res = lab.run(ParallelConfig(dp=2, compile=True), model=model, steps=1, data="text", timeout=540)
print("RESULT " + json.dumps({"kernel": _compiled_with(), "engines": lab.apply(_compiled_with)}))
"""
"""A's Lab runs compiled (ParallelConfig.compile: torch.compile on every engine); what each engine
compiled with, and whether B's code ran there (the planted constructor sets PLANTED_BY_B)."""


def _b(kernel: Kernel, call: str):
    return kernel.result(f"print('RESULT ' + json.dumps({call}))")


def compile_squat(students: Students, a_kernel: Kernel, b_kernel: Kernel) -> dict:
    """B makes /tmp/torchinductor_<A> first, with a precompiled header of B's; A's Lab then compiles."""
    a = students.names[0]
    drop = f"/tmp/lk-drop-{students.tag}"
    planted = _b(b_kernel, f"plant_compile_cache({a!r}, {drop!r})")
    compiled = a_kernel.result(COMPILE, timeout=600)
    return {"planted": planted, "compiled": compiled, "b_got": _b(b_kernel, f"dropped({drop!r})"), "drop": drop}


def snoop_and_forge(info: dict, b_kernel: Kernel, service, targets: list) -> dict:
    """B reads /proc for A's sockets and command lines, takes A's Lab's tag from its watchdog's command
    line and starts an 'engine' of A's Lab with it, tries the host's service, and widens its cores.
    Where B cannot read the tag, the test hands it over (a tag is no secret): the census must hold anyway."""
    a_pids = [info["kernel"], *info["engines"]]
    seen = _b(b_kernel, f"snoop({a_pids})")
    tag_seen = _b(b_kernel, f"lab_tag({info['kernel']})")
    tag = dict(census.watchdogs())[info["kernel"]]
    forged = _b(b_kernel, f"forge_engine({tag!r})")
    try:
        rows = [r for r in census.labs() if r["kernel"] == info["kernel"]]
        by_tag_alone = [p.pid for p in psutil.process_iter() if _tagged(p, tag) and census.role(p) == "engine"]
    finally:
        _end(forged)
    return {
        "snooped": seen,
        "tag_seen": tag_seen == tag,
        "forged": forged,
        "a_row": rows,
        "by_tag_alone": by_tag_alone,
        **_reach(b_kernel, service, targets),
        "cores": _b(b_kernel, "widen_cores()"),
    }


def _reach(b_kernel: Kernel, service, targets: list) -> dict:
    served = len(service.served)
    reached = _b(b_kernel, f"reach({targets})")
    return {"reached": reached, "service_served": service.served[served:]}


def _tagged(p: psutil.Process, tag: str) -> bool:
    try:
        return p.environ().get(TAG) == tag
    except psutil.Error:
        return False


def _end(pid: int) -> None:
    try:
        p = psutil.Process(pid)
        p.kill()
        p.wait(10)
    except psutil.Error:
        pass


def stay_and_stop(hub: Hub, students: Students, b_kernel: Kernel, grace_s: float = 3.0) -> dict:
    """B leaves a process that forks on SIGTERM, a shared-memory segment and temporary files, and the
    hub stops B's server: what was there before the stop, and what is left after it."""
    b = students.names[1]
    uid = students.uid(b)
    left = _b(b_kernel, f"stay({'lk-stay-' + students.tag!r})")
    pid = left["pid"]
    before = {
        "namespaces": namespaces(pid),
        "cgroups": cgroup_dirs(pid),
        "shm": shm_of(uid, pid),  # in B's IPC namespace (the host's, on a plain spawner)
        "files": temp_files_of(uid, f"/proc/{pid}/root"),  # as B's mount namespace shows them
    }
    hub.stop(b)
    time.sleep(grace_s)  # as long as the classroom's sweep gives what is left to end by itself
    held = {k: v for k, v in before["namespaces"].items() if v != namespaces(os.getpid())[k]}
    after = {
        "processes": [f"{p.pid} {' '.join(p.cmdline())}" for p in students.processes(b)],
        "namespace_holders": holders(held),
        "cgroups": [d for d in before["cgroups"] if os.path.isdir(d)],
        "shm": shm_of(uid),
        "files": temp_files_of(uid),
        "tmpdir": [f for f in left["files"] if f.startswith(students.home(b))],
    }
    after["tmpdir"] = [f for f in after["tmpdir"] if os.path.exists(f)]
    return {"left": left, "before": before, "after": after}


def clean_after(students: Students, squat: str, drop: str) -> list[str]:
    """What a plain spawner leaves of the students, removed: their processes, segments and files in
    the host's temporary directories, B's squatted cache and drop (the classroom leaves none)."""
    removed = []
    for name in students.names:
        uid = students.uid(name)
        removed += students.end_processes(name)
        for shmid in shm_of(uid):
            subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True, timeout=30)
            removed.append(f"shm {shmid}")
        for path in temp_files_of(uid):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
            removed.append(path)
    for path in (squat, drop):
        shutil.rmtree(path, ignore_errors=True)
    return removed


def dump(what: str, got: dict) -> None:
    print(f"\n{what}: " + json.dumps(got, indent=1, default=str))
