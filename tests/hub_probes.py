"""What the test (root, on the host) looks at to judge a student's attacks and a stop: a service the
host runs on every interface, a process's namespaces and cgroups, the System V IPC and temporary
files a user holds, and whether anything still holds a namespace that should be gone."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

from hub_tools import CLASSROOM

sys.path.insert(0, str(CLASSROOM))
from student_cgroup import _mounts, _own  # noqa: E402  (where each hierarchy is, a process's cgroups)

TEMPORARY = ("/tmp", "/var/tmp", "/dev/shm")
BANNER = b"a host service\n"


class HostService:
    """A TCP service of the host's on every address, IPv4 and IPv6 (`::`, dual-stack), as a database
    or a notebook server bound to 0.0.0.0 is: it says BANNER to whoever connects. Ends at close()."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.bind(("::", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)  # so that the loop sees close() within half a second
        self.port = self.sock.getsockname()[1]
        self.served: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                self.served.append(peer[0])
                conn.sendall(BANNER)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def link_local(interface: str) -> str:
    """The IPv6 link-local address the kernel gave `interface` (every veth has one)."""
    got = subprocess.run(
        ["ip", "-6", "-o", "addr", "show", "dev", interface, "scope", "link"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    for field in got.stdout.split():
        if field.startswith("fe80:"):
            return field.split("/")[0]
    raise RuntimeError(f"{interface} has no IPv6 link-local address: {got.stdout or got.stderr}")


def namespaces(pid: int) -> dict[str, int]:
    """The inode of each of `pid`'s mount, IPC and network namespaces."""
    return {kind: os.stat(f"/proc/{pid}/ns/{kind}").st_ino for kind in ("mnt", "ipc", "net")}


def holders(inodes: dict[str, int]) -> list[str]:
    """Every process still in one of those namespaces ('PID KIND')."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        for kind, ino in inodes.items():
            try:
                if os.stat(f"/proc/{d}/ns/{kind}").st_ino == ino:
                    out.append(f"{d} {kind}")
            except OSError:
                pass
    return out


def cgroup_dirs(pid: int) -> list[str]:
    """The directories of `pid`'s cgroups outside each hierarchy's root (none for a process in the roots)."""
    mounts, own = _mounts(), _own(f"/proc/{pid}/cgroup")
    return sorted({mounts[h] + path for h, path in own.items() if h in mounts and path != "/"})


def shm_of(uid: int, pid: int | None = None) -> list[int]:
    """The ids of the System V shared-memory segments `uid` owns, in the host's IPC namespace, or in `pid`'s."""
    cmd = ["cat", "/proc/sysvipc/shm"] if pid is None else ["nsenter", "-t", str(pid), "-i", "cat", "/proc/sysvipc/shm"]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    rows = [line.split() for line in got.stdout.splitlines()[1:]]
    return [int(r[1]) for r in rows if int(r[7]) == uid]  # shmid, and uid (the fields' header names them)


def temp_files_of(uid: int, root: str = "") -> list[str]:
    """What `uid` owns at the top of each temporary directory, as the host sees them (or under `root`:
    /proc/PID/root, the view of PID's mount namespace)."""
    out = []
    for d in TEMPORARY:
        try:
            entries = os.listdir(root + d)
        except OSError:
            continue
        for e in entries:
            try:
                if os.lstat(f"{root}{d}/{e}").st_uid == uid:
                    out.append(f"{d}/{e}")
            except OSError:
                pass
    return sorted(out)
