"""A student's cgroup: every process of their server in it from the first (the spawner's child joins
it before it runs the server), its cores (cpuset) and memory enforced there, and all of it ended at
once at a stop (cgroup.kill: no process can fork its way out of a kill that takes the whole group).

Where the cgroups go (the choice, written down):
  - cgroup v2 (the unified hierarchy, /sys/fs/cgroup on current distributions; /sys/fs/cgroup/unified
    beside v1 on a hybrid machine): `<the hub's cgroup's parent>/labkit-classroom/<student>`. Beside
    the hub's cgroup, not below it: v2 hands controllers (cpuset, memory) only to the children of a
    cgroup that holds no process itself, and the hub's cgroup holds the hub (under systemd:
    system.slice/labkit-classroom, next to jupyterhub.service). A controller v2 lacks (on a hybrid
    machine all of them are v1's) is taken from its v1 hierarchy;
  - cgroup v1 (a controller's own hierarchy): `<the hub's cgroup>/labkit-classroom/<student>`, below
    the hub's, so that a limit the hub's service has holds for its students too.
A stop ends the group with cgroup.kill where the kernel has it (Linux 5.14), else by freezing it
(cgroup.freeze, or v1's freezer), killing every process in it and thawing it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT = "labkit-classroom"
"""The cgroup every student's is made in (the hub's choice above)."""
_LOCK = threading.Lock()


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> dict[str, str]:
    """Where each hierarchy is mounted: 'v2' -> the cgroup2 mount, and each v1 controller -> its mount."""
    out: dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = right.split()[:3]
            where = left.split()[4]
            if fstype == "cgroup2":
                out.setdefault("v2", where)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    out.setdefault(opt, where)  # rw, relatime, ... too: never asked for
    return out


def _own(proc_cgroup: str = "/proc/self/cgroup") -> dict[str, str]:
    """This process's cgroup in each hierarchy: 'v2' -> its path, each v1 controller -> its path."""
    out = {}
    with open(proc_cgroup) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else ["v2"]:
                out[c] = path
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class StudentCgroup:
    """The cgroups of one student's server: `dirs` maps what each is for ('kill', 'cpuset',
    'memory') to its directory; a directory may serve several (v2 holds them all in one)."""

    def __init__(self, name: str, *, cores: list[int], memory: int | None, mounts=None, own=None):
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"cgroup name {name!r}: a user name, without '/'")
        self.name, self.cores, self.memory = name, list(cores), memory
        mounts = _mounts() if mounts is None else mounts
        own = _own() if own is None else own
        v2 = mounts.get("v2")
        have_v2 = set(_read(f"{v2}/cgroup.controllers").split()) if v2 else set()
        self.dirs: dict[str, str] = {}
        self.v2_root = v2 or "/nonexistent"
        if v2:
            parent = os.path.dirname(own.get("v2", "/").rstrip("/")) or "/"
            self.dirs["kill"] = os.path.join(v2 + parent, PARENT, name)
        elif "freezer" in mounts:
            self.dirs["kill"] = os.path.join(mounts["freezer"] + own.get("freezer", "/"), PARENT, name)
        else:
            raise RuntimeError("the classroom needs cgroups: no cgroup2 or v1 freezer hierarchy is mounted")
        for controller, wanted in (("cpuset", bool(self.cores)), ("memory", bool(memory))):
            if not wanted:
                continue
            if v2 and controller in have_v2:
                self.dirs[controller] = self.dirs["kill"]
            elif controller in mounts:
                self.dirs[controller] = os.path.join(mounts[controller] + own.get(controller, "/"), PARENT, name)
            else:
                raise RuntimeError(
                    f"enforcing each student's {'cores' if controller == 'cpuset' else 'memory'} needs the "
                    f"{controller} cgroup controller, which this machine does not have "
                    f"(set {'cores_per_student = 0' if controller == 'cpuset' else 'mem_limit = None'} to go without)"
                )

    @classmethod
    def of(cls, name: str, dirs: dict[str, str]) -> StudentCgroup:
        """The cgroup whose directories a hub recorded (`dirs`, as `self.dirs` had them): to end and remove it."""
        self = cls.__new__(cls)
        self.name, self.cores, self.memory, self.dirs = name, [], None, dict(dirs)
        self.v2_root = "/nonexistent"
        return self

    def make(self) -> None:
        """Make the directories and write the limits (as root, before the server starts)."""
        with _LOCK:  # the hub starts and stops several students at once; they share the parent
            for d in dict.fromkeys(self.dirs.values()):
                parent, v2 = os.path.dirname(d), d.startswith(self.v2_root + "/")
                if v2:  # v2: a level hands on to its children only the controllers switched on in it
                    self._enable(os.path.dirname(parent), d)
                self._mkdir(parent, v2)
                if v2:
                    self._enable(parent, d)
                self._mkdir(d, v2)
            if self.cores:
                _write(f"{self.dirs['cpuset']}/cpuset.cpus", ",".join(map(str, self.cores)))
            if self.memory:
                d = self.dirs["memory"]
                limit = "memory.max" if os.path.exists(f"{d}/memory.max") else "memory.limit_in_bytes"
                _write(f"{d}/{limit}", str(self.memory))

    @staticmethod
    def _mkdir(level: str, v2: bool) -> None:
        try:
            os.mkdir(level)
        except FileExistsError:
            return
        if not v2 and os.path.exists(f"{level}/cpuset.mems"):  # a v1 cpuset starts empty: no task may join
            above = os.path.dirname(level)
            _write(f"{level}/cpuset.mems", _read(f"{above}/cpuset.mems"))
            _write(f"{level}/cpuset.cpus", _read(f"{above}/cpuset.cpus"))

    def _enable(self, level: str, d: str) -> None:
        wanted = [c for c, where in self.dirs.items() if where == d and c != "kill"]
        if not wanted:
            return
        on = set(_read(f"{level}/cgroup.subtree_control").split())
        missing = [c for c in wanted if c not in on]
        if missing:
            _write(f"{level}/cgroup.subtree_control", " ".join(f"+{c}" for c in missing))

    def join(self) -> None:
        """Put this process in every one of the student's cgroups: in the spawner's child, before it
        drops root (the student cannot move themselves: cgroup.procs is root's)."""
        me = str(os.getpid())
        for d in dict.fromkeys(self.dirs.values()):
            _write(f"{d}/cgroup.procs", me)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(f"{self.dirs['kill']}/cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def wait_empty(self, seconds: float) -> list[int]:
        """Wait up to `seconds` for the group to empty; what is left."""
        deadline = time.monotonic() + seconds
        left = self.pids()
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = self.pids()
        return left

    def kill(self, seconds: float = 10.0) -> list[int]:
        """End every process in the group at once; what it ended. Raises if some are left after
        `seconds` (a process in uninterruptible sleep on a dead NFS server, say)."""
        d = self.dirs["kill"]
        seen = self.pids()
        if not seen:
            return []
        if os.path.exists(f"{d}/cgroup.kill"):
            _write(f"{d}/cgroup.kill", "1")
        else:  # a frozen group cannot fork while it is killed one by one
            freeze, frozen, thawed = (
                ("cgroup.freeze", "1", "0")
                if os.path.exists(f"{d}/cgroup.freeze")
                else ("freezer.state", "FROZEN", "THAWED")
            )
            _write(f"{d}/{freeze}", frozen)
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _write(f"{d}/{freeze}", thawed)
        left = self.wait_empty(seconds)
        if left:
            raise RuntimeError(f"{self.name}'s cgroup {d} still holds {left} {seconds:g} s after a kill")
        return seen

    def remove(self) -> None:
        """Remove the student's directories, and the parent where no other student's is left."""
        with _LOCK:
            for d in dict.fromkeys(self.dirs.values()):
                for level in (d, os.path.dirname(d)):
                    try:
                        os.rmdir(level)
                    except FileNotFoundError:
                        pass
                    except OSError:  # another student's cgroup is still in the parent
                        break
