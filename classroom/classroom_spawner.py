"""The classroom's spawner: JupyterHub's LocalProcessSpawner (one Unix user per student), with each
student's server, kernels and Labs apart from every other student's.

Why: a Lab's cluster listens on 127.0.0.1, and on one machine 127.0.0.1 is every user's; ipyparallel
signs its messages, but its PUB sockets hand any subscriber the engines' output, and torch.distributed's
rendezvous store and gloo's sockets check nobody; /tmp, /dev/shm and /proc are every user's too
(classroom/README.md has what student B could do to student A, measured). Per student (a "slot", the
lowest free number), the spawner gives the server:
  - a network namespace with one veth link (a /30) to the host, and a firewall on the host's end that
    lets through only the hub's API port and replies (student_net.py);
  - a cgroup that holds every process the server starts, enforces its cores (`cores_per_student`,
    handed out round-robin by slot) and memory (`mem_limit`), and ends all of them at a stop
    (student_cgroup.py);
  - mount and IPC namespaces with their own /tmp, /var/tmp, /dev/shm and System V IPC, a /proc that
    shows the student's own processes only, TMPDIR and the compile caches in the home (student_space.py);
  - a private home (0700) and umask 077; `gpus_per_student` GPUs (CUDA_VISIBLE_DEVICES by UUID).
A stop (the admin's stop button, the idle culler, a crash) ends the cgroup, then whatever else runs as
the student or in their namespace, and removes the namespace, the link, the firewall, the cgroup and TMPDIR.

Needs root (as LocalProcessSpawner does), iproute2's `ip`, nftables' `nft`, cgroups (v2, or v1's cpuset,
memory and freezer), and the hub reachable from the students' namespaces:
c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081" (the proxy already publishes the hub's pages and API;
this only adds the route to it over each student's own link).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import time

import psutil
from jupyterhub.spawner import LocalProcessSpawner

# its parts, beside it: classroom/ is on sys.path (jupyterhub_config.py puts it there)
from student_cgroup import StudentCgroup
from student_net import join_netns, link, netns_down, netns_up
from student_space import directories, empty_tmpdir, enter_private_space, make_directories
from traitlets import Bool, Float, Integer, Unicode

from labkit.cluster.census import live_processes
from labkit.cluster.gpus import read_table  # the machine's GPUs: NVML or nvidia-smi

__all__ = ["ClassroomSpawner", "link", "share_out", "sweep"]
_slots: dict[str, int] = {}
"""user name -> slot, for the servers this hub runs (their /30, cores and GPUs follow from it)."""


def share_out(items: list, per: int, slot: int) -> list:
    """The `per` items of `slot` (1, 2, ...), handed out round-robin: slot 1 the first `per`, slot 2
    the next, wrapping around the list (more students than items share them)."""
    if per <= 0 or not items:
        return []
    if per > len(items):
        raise ValueError(f"{per} per student, and the machine has {len(items)}: ask for at most {len(items)}")
    start = (slot - 1) * per
    return [items[(start + k) % len(items)] for k in range(per)]


def inside(netns_path: str, uid: int) -> list[psutil.Process]:
    """Every process in the network namespace at `netns_path`, or owned by `uid`."""
    try:
        ns = os.stat(netns_path)
        want = (ns.st_dev, ns.st_ino)
    except OSError:
        want = None
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:  # ended already; its parent (or init) reaps it
            continue
        try:
            if p.info["uids"] and p.info["uids"].real == uid:
                out.append(p)
                continue
            st = os.stat(f"/proc/{p.pid}/ns/net")
            if want and (st.st_dev, st.st_ino) == want:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def sweep(netns_path: str, uid: int, kill_after_s: float = 2.0, reap_s: float = 10.0) -> dict:
    """End what a student runs outside their server's cgroup (an ssh login's job, a process root
    started as them in their namespace): SIGTERM, then SIGKILL what is left after `kill_after_s`."""
    left = inside(netns_path, uid)
    ended = [_named(p) for p in left]
    for p in left:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=kill_after_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=kill_after_s)
    return {"ended": ended, "killed": [p.pid for p in alive], "left": unreaped(uid, reap_s)}


def unreaped(uid: int, seconds: float) -> list[int]:
    """Wait up to `seconds` until no process of `uid` is left, zombies included (a killed process whose
    parent died with it is reaped by init a moment later: a stop ends when they are gone); what is left."""
    deadline = time.monotonic() + seconds
    while True:
        left = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _named(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.username()} {' '.join(p.cmdline()[:3])}"
    except (psutil.Error, KeyError):
        return str(p.pid)


class ClassroomSpawner(LocalProcessSpawner):
    """LocalProcessSpawner with each student's server in namespaces and a cgroup of its own, its home
    private, its cores, memory and GPUs handed out by slot, and nothing of it left after a stop."""

    network = Unicode(
        "10.44.0.0/16", config=True, help="Where the students' links are numbered: a /30 per student, none routed"
    )
    veth = Unicode("lkc", config=True, help="The students' veth names: this, the slot, h (hub's end) or s")
    cores_per_student = Integer(
        0, config=True, help="CPU cores each student's server runs on (its cgroup's cpuset); 0: every core"
    )
    gpus_per_student = Integer(
        1, config=True, help="GPUs each student's server sees (CUDA_VISIBLE_DEVICES); 0: every GPU. None on CPU"
    )
    tmp_size = Unicode(
        "1g", config=True, help="Size of each of a student's own /tmp, /var/tmp, /dev/shm (tmpfs: 512m, 2g, 10%)"
    )
    private_home = Bool(True, config=True, help="Make each student's home directory 0700 before their server starts")
    sweep_grace_s = Float(
        5.0, config=True, help="After a stop: how long what the server started may take to end by itself"
    )
    slot = Integer(0, help="This student's slot: their /30, cores and GPUs")
    made: dict = {}
    """What this hub made for the student's server (netns, veth, cgroup dirs), kept in the hub's
    database (get_state): the only things a start removes as a dead hub's leftovers."""
    last_sweep = None
    """What the last stop ended ({'cgroup', 'outside', 'left'}), for the hub's log."""
    _cgroup: StudentCgroup | None = None
    _cores: list[int] = []  # this server's cores, for the preexec function (set by start)

    @property
    def netns(self) -> str:
        return f"labkit-{self.user.name}"

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    def _take_slot(self) -> int:
        taken = {s for name, s in _slots.items() if name != self.user.name}
        if self.slot and self.slot not in taken:
            slot = self.slot  # kept across a hub restart (get_state)
        else:
            slot = next(k for k in range(1, 1 << 20) if k not in taken)
        link(self.network, slot)  # a network too small says so here, before anything is made
        if not (self.veth.isalnum() and len(self.veth) + len(str(slot)) + 1 <= 15):  # Linux's IFNAMSIZ - 1
            raise ValueError(f"veth={self.veth!r}: a short alphanumeric prefix (interface names have 15 characters)")
        if not re.fullmatch(r"[1-9][0-9]*[kmgKMG%]?", self.tmp_size):
            raise ValueError(f"tmp_size={self.tmp_size!r}: a tmpfs size, as 512m, 2g or 10%")
        _slots[self.user.name] = self.slot = slot
        return slot

    def _share(self, slot: int) -> tuple[list[int], list[str]]:
        """This slot's cores (of the hub's own affinity) and GPU UUIDs."""
        cores = share_out(sorted(os.sched_getaffinity(0)), self.cores_per_student, slot)
        table = read_table() if self.gpus_per_student else []
        gpus = share_out([g.uuid or str(g.index) for g in table], self.gpus_per_student, slot)
        return cores, gpus

    async def start(self):
        if self.hub.ip not in ("", "0.0.0.0", "::"):
            raise RuntimeError(
                f"the hub listens on {self.hub.ip} only, which a student's network namespace cannot reach: "
                "set c.JupyterHub.hub_bind_url = 'http://0.0.0.0:8081' (classroom/jupyterhub_config.py)"
            )
        slot = self._take_slot()
        if self.made:  # a dead hub's, recorded in its database: this student's, and so ours to remove
            await asyncio.to_thread(self._remove, self.made)
        try:
            cores, gpus = self._share(slot)
            home = pwd.getpwnam(self.user.name).pw_dir
            if self.private_home and os.path.isdir(home) and os.stat(home).st_mode & 0o077:
                self.log.info("making %s's home %s private (0700)", self.user.name, home)
                os.chmod(home, 0o700)
            cgroup = StudentCgroup(self.user.name, cores=cores, memory=self.mem_limit)
            host, student = await asyncio.to_thread(netns_up, self.netns, slot, self.network, self.veth, self.hub.port)
            self.made = {"netns": self.netns, "slot": slot, "veth": self.veth}
            self.made["cgroup"] = dict(cgroup.dirs)
            await asyncio.to_thread(cgroup.make)
        except BaseException:  # nothing half-made stays: the slot, and what this start made
            await asyncio.to_thread(self._remove, self.made)
            _slots.pop(self.user.name, None)
            raise
        self._cgroup, self._cores = cgroup, cores
        # the server listens on its own end of the link; the hub answers on the host's end
        self.ip, self.port = student, self.port or 8888
        self.hub_connect_url = f"http://{host}:{self.hub.port}"
        self.environment = {**self.environment, **directories(home)}
        if gpus:
            self.environment["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self.log.info(
            "%s: slot %d, netns %s at %s, cores %s, memory %s, gpus %s",
            *(self.user.name, slot, self.netns, student, cores, self.mem_limit, gpus),
        )
        return await super().start()

    def make_preexec_fn(self, name):
        setuid = super().make_preexec_fn(name)
        cgroup, path, cores, size = self._cgroup, self.netns_path, self._cores, self.tmp_size
        home_dirs = directories(pwd.getpwnam(name).pw_dir)

        def preexec():  # in the server's process, between fork and exec; root until setuid()
            cgroup.join()  # first: everything after, and everything it starts, is the cgroup's
            join_netns(path)
            enter_private_space(size)
            if cores:
                os.sched_setaffinity(0, cores)  # what labkit reads (its share); the cpuset enforces it
            os.umask(0o077)
            setuid()
            make_directories(home_dirs)

        return preexec

    async def stop(self, now=False):
        # what the start made, before the parent's poll clears the state (clear_state) once the server is gone
        made, cgroup = dict(self.made), self._cgroup
        await super().stop(now=now)
        if cgroup is not None:  # the kernels end with the server, and each Lab with its kernel (labkit's watchdog)
            await asyncio.to_thread(cgroup.wait_empty, 0.0 if now else self.sweep_grace_s)
        self.last_sweep = await asyncio.to_thread(self._remove, made, cgroup)
        self.log.info("%s stopped: %s", self.user.name, self.last_sweep)
        _slots.pop(self.user.name, None)

    def _remove(self, made: dict, cgroup: StudentCgroup | None = None) -> dict:
        """End every process of the student's server, then whatever else runs as them or in their
        namespace, and remove what `made` names. Returns what it ended."""
        user = pwd.getpwnam(self.user.name)
        if cgroup is None and made.get("cgroup"):
            cgroup = StudentCgroup.of(self.user.name, made["cgroup"])
        ended = {"cgroup": [], "outside": [], "left": []}
        if cgroup is not None:
            ended["cgroup"] = [_named(p) for p in live_processes(cgroup.pids())]
            cgroup.kill()
        if made.get("netns"):
            outside = sweep(f"/run/netns/{made['netns']}", user.pw_uid)
            ended["outside"], ended["left"] = outside["ended"], outside["left"]
            netns_down(made["netns"], made["slot"], made["veth"])
        if cgroup is not None:
            cgroup.remove()
        empty_tmpdir(directories(user.pw_dir)["TMPDIR"], user.pw_uid, user.pw_gid)
        self.made = {}
        return ended

    def get_state(self):
        state = super().get_state()
        if self.slot:
            state["slot"] = self.slot
        if self.made:
            state["made"] = self.made
        return state

    def load_state(self, state):
        super().load_state(state)
        if state.get("slot"):
            self.slot = _slots[self.user.name] = state["slot"]
        self.made = dict(state.get("made") or {})

    def clear_state(self):
        super().clear_state()
        self.slot = 0


def _processes(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out
