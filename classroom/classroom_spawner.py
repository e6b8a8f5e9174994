"""The classroom's spawner: JupyterHub's LocalProcessSpawner (one Unix user per student), with each
student's server, kernels and Labs in a network namespace of their own.

Why a namespace: a Lab's cluster listens on 127.0.0.1, and on one machine 127.0.0.1 is every user's.
ipyparallel signs its messages, but its PUB sockets hand any subscriber the engines' output, and
torch.distributed's rendezvous store and gloo's sockets check nobody (classroom/README.md has what
student B could do to student A, measured). In a namespace of its own a student's 127.0.0.1 is
theirs alone: every port of every Lab (and of the notebook's own kernel) is out of the other
students' reach, whatever opens it, with no change to torch or ipyparallel. The server itself is
reached by the proxy over a veth pair, one /30 per student, with no route to the other students'.

What else it does, per student (a "slot", the lowest free number):
  - the home directory is made private (0700) and the server runs with umask 077: the engines'
    logs and the Lab's files are the student's alone;
  - the server runs on `cores_per_student` cores of the hub's (CPU affinity, inherited by the
    kernel and the engines; labkit reads it: labkit/cluster/share.py), and sees `gpus_per_student`
    GPUs (CUDA_VISIBLE_DEVICES by UUID), both handed out round-robin by slot;
  - when the hub stops the server (the admin's stop button, the idle culler, a crash), every
    process left in the student's namespace or owned by the student ends (SIGTERM, then SIGKILL),
    and the namespace goes.

Needs root (as LocalProcessSpawner does), iproute2's `ip`, and the hub reachable from the students'
namespaces: c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081" (the proxy already publishes the
hub's pages and API; this only adds the route to it over each student's own link).
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import os
import pwd
import subprocess
import time

import psutil
from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Bool, Float, Integer, Unicode

from labkit.cluster.gpus import read_table  # the machine's GPUs: NVML or nvidia-smi

CLONE_NEWNET = 0x40000000  # <sched.h>: setns() into a network namespace
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork calls setns through it
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


def link(network: str, slot: int) -> tuple[str, str, str]:
    """(host end, student end, prefix) of slot's /30 in `network`: slot 1 of 10.44.0.0/16 is
    10.44.0.5 (the hub's side) and 10.44.0.6 (the student's); slot 0's /30 is never used."""
    net = ipaddress.ip_network(network)
    if net.version != 4 or net.prefixlen > 28:
        raise ValueError(f"network={network!r}: give an IPv4 network of /28 or wider (each student takes a /30)")
    if not 1 <= slot < net.num_addresses // 4:
        raise ValueError(f"slot {slot}: network={network} has room for {net.num_addresses // 4 - 1} students")
    base = net.network_address + 4 * slot
    return str(base + 1), str(base + 2), "30"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def netns_up(name: str, slot: int, network: str, veth: str = "lkc") -> tuple[str, str]:
    """Network namespace `name` with loopback up and one veth to the host (named `veth`, the slot,
    h or s): (host end, student end). No default route: the student's side reaches its /30 (the
    hub) and nothing else."""
    host, student, prefix = link(network, slot)
    outside, inside = f"{veth}{slot}h", f"{veth}{slot}s"
    netns_down(name, slot, veth)  # a namespace left by a hub that died
    ip("netns", "add", name)
    ip("link", "add", outside, "type", "veth", "peer", "name", inside)
    ip("link", "set", inside, "netns", name)
    ip("addr", "add", f"{host}/{prefix}", "dev", outside)
    ip("link", "set", outside, "up")
    ip("-n", name, "addr", "add", f"{student}/{prefix}", "dev", inside)
    ip("-n", name, "link", "set", inside, "up")
    ip("-n", name, "link", "set", "lo", "up")
    return host, student


def netns_down(name: str, slot: int, veth: str = "lkc") -> None:
    ip("link", "del", f"{veth}{slot}h", check=False)  # its peer goes with it
    ip("netns", "del", name, check=False)


def join_netns(path: str) -> None:
    """Move this process into the network namespace at `path` (needs CAP_SYS_ADMIN: before setuid)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def inside(netns_path: str, uid: int) -> list[psutil.Process]:
    """Every process in the network namespace at `netns_path`, or owned by `uid`."""
    try:
        ns = os.stat(netns_path)
        want = (ns.st_dev, ns.st_ino)
    except OSError:
        want = None
    out = []
    for p in psutil.process_iter(["uids"]):
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


def sweep(netns_path: str, uid: int, grace_s: float, kill_after_s: float = 2.0) -> dict:
    """End what is left of a student's server: wait up to `grace_s` for the processes to end by
    themselves (the server ends its kernels, a kernel's end ends its Labs: labkit's watchdog),
    then SIGTERM, and SIGKILL what is left after `kill_after_s`. Returns what it saw and did."""
    deadline = time.monotonic() + grace_s
    left = inside(netns_path, uid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
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
    return {"ended": ended, "killed": [p.pid for p in alive], "left": [p.pid for p in inside(netns_path, uid)]}


def _named(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.username()} {' '.join(p.cmdline()[:3])}"
    except (psutil.Error, KeyError):
        return str(p.pid)


class ClassroomSpawner(LocalProcessSpawner):
    """LocalProcessSpawner with each student's server in a network namespace of its own, its home
    private, its cores and GPUs handed out by slot, and nothing of it left after a stop."""

    network = Unicode(
        "10.44.0.0/16", config=True, help="Where the students' links are numbered: a /30 per student, none routed"
    )
    veth = Unicode("lkc", config=True, help="The students' veth names: this, the slot, h (hub's end) or s")
    cores_per_student = Integer(
        0, config=True, help="CPU cores each student's server runs on (its affinity); 0: every core, unpinned"
    )
    gpus_per_student = Integer(
        1, config=True, help="GPUs each student's server sees (CUDA_VISIBLE_DEVICES); 0: every GPU. None on CPU"
    )
    private_home = Bool(True, config=True, help="Make each student's home directory 0700 before their server starts")
    sweep_grace_s = Float(
        5.0, config=True, help="After a stop: how long what the server started may take to end by itself"
    )
    slot = Integer(0, help="This student's slot: their /30, cores and GPUs")
    _cores: list[int] = []  # this server's cores, for the preexec function (set by start)
    last_sweep = None
    """What the last stop's sweep saw and did ({'ended', 'killed', 'left'}), for the hub's log."""

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
        try:
            cores, gpus = self._share(slot)
            home = pwd.getpwnam(self.user.name).pw_dir
            if self.private_home and os.path.isdir(home) and os.stat(home).st_mode & 0o077:
                self.log.info("making %s's home %s private (0700)", self.user.name, home)
                os.chmod(home, 0o700)
            host, student = await asyncio.to_thread(netns_up, self.netns, slot, self.network, self.veth)
        except BaseException:  # nothing half-made stays: the slot, the namespace
            await asyncio.to_thread(netns_down, self.netns, slot, self.veth)
            _slots.pop(self.user.name, None)
            raise
        self._cores = cores
        # the server listens on its own end of the link; the hub answers on the host's end
        self.ip, self.port = student, self.port or 8888
        self.hub_connect_url = f"http://{host}:{self.hub.port}"
        if gpus:
            self.environment = {**self.environment, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        self.log.info(
            "%s: slot %d, netns %s at %s, cores %s, gpus %s", self.user.name, slot, self.netns, student, cores, gpus
        )
        return await super().start()

    def make_preexec_fn(self, name):
        setuid = super().make_preexec_fn(name)
        path, cores = self.netns_path, self._cores

        def preexec():
            join_netns(path)  # as root still: setuid comes last
            if cores:
                os.sched_setaffinity(0, cores)
            os.umask(0o077)
            setuid()

        return preexec

    async def stop(self, now=False):
        # the slot before the parent's poll clears the state (clear_state) once the server is gone
        slot = _slots.get(self.user.name, self.slot)
        await super().stop(now=now)
        uid = pwd.getpwnam(self.user.name).pw_uid
        self.last_sweep = await asyncio.to_thread(sweep, self.netns_path, uid, 0.0 if now else self.sweep_grace_s)
        self.log.info("%s stopped: %s", self.user.name, self.last_sweep)
        if slot:
            await asyncio.to_thread(netns_down, self.netns, slot, self.veth)
        _slots.pop(self.user.name, None)

    def get_state(self):
        state = super().get_state()
        if self.slot:
            state["slot"] = self.slot
        return state

    def load_state(self, state):
        super().load_state(state)
        if state.get("slot"):
            self.slot = _slots[self.user.name] = state["slot"]

    def clear_state(self):
        super().clear_state()
        self.slot = 0
