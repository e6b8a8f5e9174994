"""A Lab's engines: the ipyparallel client (and the local cluster it started), which engine is
which rank (engine id, pid, host, device), the torch.distributed world built on them, and calls
on them that never wait without a bound. How they are started or found is labkit/cluster/startup.py.

Every wait here has a bound; an engine that is gone or silent becomes `EngineGone`, which the
job runner (labkit/cluster/jobs.py) turns into EngineDied. Engines found bad are marked here and
replaced by `replace` (clusters this Lab started, through their launcher) before the next call.
An engine on this machine is watched by its pid; one elsewhere by its registration.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from urllib.parse import urlparse

import ipyparallel as ipp
import psutil

from labkit.cluster import launchers, watchdog
from labkit.cluster.errors import LabError
from labkit.cluster.share import share_rows
from labkit.cluster.world import forwarded_env, host_order, watchable, world_setup
from labkit.config.table import Rows
from labkit.engines import host, process_group

START_TIMEOUT_S = launchers.START_TIMEOUT_S
"""Bound on starting engines (the launchers' own), building the process groups and bringing
results back."""
ANSWER_S = 20.0
"""An engine that does not answer a poll within this long is taken for dead (its job runs in a
thread, so a live engine answers within milliseconds even mid-step)."""
REPLACE_WAIT_S = 120.0
"""Bound on new engines registering with the controller (a replacement, a restart)."""


class EngineGone(Exception):
    """Ranks whose engine is gone (or silent); the job runner turns it into EngineDied."""

    def __init__(self, ranks, detail: str):
        self.ranks, self.detail = sorted(ranks), detail
        super().__init__(detail)


class EngineSet:
    """The engines of one Lab, in rank order, and the torch world on them.

    client, cluster: ipyparallel's (cluster: the one this Lab started, else None); started: how
    it was started (launchers.Started), watchdog: the process that ends it if the kernel dies.
    ids, pids, hosts, devices: per rank; here: whether rank r's engine is on this machine (its pid
    can be watched). backend, port (the rendezvous), world (ranks).
    lock: held by whoever talks to the engines (a job from start to end, a poll of the states,
    activate's set-up, close); reentrant.
    """

    def __init__(
        self,
        client,
        cluster=None,
        n: int | None = None,
        *,
        local: bool,
        backend: str = "auto",
        device: str = "auto",
        timeout: float,
        master_addr: str | None = None,
        started: launchers.Started | None = None,
        watchdog: watchdog.Watchdog | None = None,
        gpu_memory_fraction: float | None = None,
    ):
        self.client, self.cluster, self.local = client, cluster, local
        self.started, self.watchdog = started, watchdog
        self.gpu_memory_fraction = gpu_memory_fraction
        self._n = len(client.ids) if n is None else n  # how many engines a restart starts
        self.backend_choice, self.device_choice = backend, device
        self.timeout = timeout  # the world's default group timeout (each job sets its own)
        self.master_addr = master_addr
        self.lock = threading.RLock()
        self.ids = sorted(client.ids)[: self._n]
        self.world = len(self.ids)
        self.hosts: list[str] = []  # the rest is learnt by setup()
        self.pids: list[int] = []
        self.here: list[bool] = []
        self.devices: list[str] = []
        self.backend = ""
        self.backend_reason = ""
        self.world_env: dict[str, str] = {}
        self.share = Rows()  # per host: the cores, threads and GPUs its engines use (labkit/cluster/share.py)
        self.port = 0
        self.addr = ""  # where rank 0's store listens: the world's rendezvous address
        self.runtimes: list[dict] = []  # each rank's runtime.Runtime, as a dict
        self.generation = 0  # how many times the world has been built
        self._known_ids = set(client.ids)
        self._condemned: dict[int, str] = {}  # rank -> why its engine must be replaced (no longer used)
        self._tainted: dict[int, str] = {}  # rank -> why its engine should be replaced (still usable)

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Give each engine (self.ids, in rank order; the first time, host by host) a rank and a
        device and build the world."""
        self.world = len(self.ids)
        toward = urlparse(self.client._config.get("registration", "")).hostname  # the controller
        got = self.gather(
            {r: self.client[e].apply_async(host.engine_info, toward) for r, e in enumerate(self.ids)},
            START_TIMEOUT_S,
            watch=False,
        )  # pids are what this learns
        infos = [got[r] for r in range(self.world)]
        if self.generation == 0:  # the first world: neighbouring ranks share a host
            order = host_order(infos)
            self.ids, infos = [self.ids[k] for k in order], [infos[k] for k in order]
        mine = host.machine()
        self.hosts = [i["host"] for i in infos]
        self.pids = [i["pid"] for i in infos]
        self.here = [watchable(i, mine) for i in infos]
        world = world_setup(
            infos,
            backend=self.backend_choice,
            device=self.device_choice,
            local=self.local,
            master_addr=self.master_addr,
            default_cpus=os.cpu_count() or 1,
        )
        self.backend, self.devices, self.backend_reason = world.backend, world.devices, world.why
        self.world_env = world.env
        self.share = share_rows(infos, world.threads, world.devices, self.gpu_memory_fraction)
        self._rendezvous(world.addr, world.threads, world.loopback, world.ifnames)

    def _rendezvous(self, addr: str, threads: list[int], loopback: bool, ifnames: list[str] | None = None) -> None:
        """A fresh port (the OS picks it on rank 0) and a new process group on every rank."""
        self.generation += 1
        # the OS picks the port on rank 0's host: one chosen here could be taken there, and a rebuilt
        # world never meets the last one's
        port = self.each(process_group.open_rendezvous, [0], addr, bound=START_TIMEOUT_S)[0]
        got = self.gather(
            {
                rank: self.client[eid].apply_async(
                    process_group.init_distributed,
                    rank,
                    self.world,
                    addr,
                    port,
                    self.backend,
                    self.devices[rank],
                    self.timeout,
                    self.generation,
                    threads[rank],
                    loopback,
                    {**self.world_env, **forwarded_env(os.environ)},  # the notebook's own NCCL_* win
                    ifnames[rank] if ifnames else None,
                    self.gpu_memory_fraction,
                )
                for rank, eid in enumerate(self.ids)
            },
            START_TIMEOUT_S,
        )
        self.runtimes = [got[r] for r in range(self.world)]
        self.port, self.addr = port, addr

    # -- bounded calls ----------------------------------------------------------------------
    def gather(self, pending: dict, bound: float, watch: bool = True) -> dict:
        """rank -> result of each AsyncResult, waiting at most `bound` seconds. Raises EngineGone
        for ranks whose engine is gone (checked while waiting) or that do not answer in time."""
        pending, out = dict(pending), {}
        deadline = time.monotonic() + bound
        while True:
            for r in [r for r, ar in pending.items() if ar.ready()]:
                try:
                    out[r] = pending.pop(r).get(0)
                except ipp.error.EngineError as e:
                    raise EngineGone([r], str(e).splitlines()[0] if str(e) else "its engine went away") from None
                except ipp.error.RemoteError as e:
                    # when the hub sees the engine go before we do, the client answers its pending
                    # tasks with the EngineError wrapped like an engine's own exception
                    if e.ename != "EngineError":
                        raise
                    raise EngineGone([r], e.evalue or "its engine went away") from None
            if not pending:
                return out
            # a dead engine shows by its pid or its registration long before the bound
            if watch:
                dead = self.dead(pending)
                if dead:
                    raise EngineGone(dead, "its process is gone")
            if time.monotonic() > deadline:
                raise EngineGone(list(pending), f"it did not answer within {bound:g} s")
            # a short wait on one result: any answer or death elsewhere is seen within 50 ms
            next(iter(pending.values())).wait(0.05)

    def each(self, fn, ranks, *args, bound: float | None = None) -> dict:
        """fn(*args) on the engines of `ranks`; rank -> result (bounded, see gather)."""
        return self.gather({r: self.send(r, fn, *args) for r in ranks}, bound or ANSWER_S)

    def send(self, rank: int, fn, *args):
        """fn(*args) on the engine of `rank`, not waited for: its AsyncResult."""
        try:
            return self.client[self.ids[rank]].apply_async(fn, *args)
        except IndexError:  # the controller has already unregistered this engine
            raise EngineGone([rank], "its engine is no longer registered with the controller") from None

    def dead(self, ranks) -> list[int]:
        """Ranks among `ranks` whose engine process is gone (on this machine: by pid; elsewhere:
        unregistered from the controller)."""
        ids = set(self.client.ids)
        out = []
        for r in ranks:
            # an engine on another machine or pid namespace: gone once the controller no longer lists it
            if not (self.here[r] if r < len(self.here) else self.local):
                if self.ids[r] not in ids:
                    out.append(r)
                continue
            try:
                # a zombie's pid still answers: its process is gone all the same
                if psutil.Process(self.pids[r]).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    out.append(r)
            except psutil.NoSuchProcess:
                out.append(r)
        return out

    def push(self, per_rank: list[dict]) -> None:
        """per_rank[r] into the namespace of rank r's engine (ipyparallel's TimeoutError past START_TIMEOUT_S)."""
        pushed = [self.client[eid].push(ns, block=False) for eid, ns in zip(self.ids, per_rank)]
        for ar in pushed:
            ar.get(timeout=START_TIMEOUT_S)

    def execute(self, code: str) -> None:
        """Python source run in every engine's namespace (bounded like push)."""
        self.view().execute(code, block=False).get(timeout=START_TIMEOUT_S)

    def view(self):
        """A DirectView on the engines, in rank order."""
        return self.client[self.ids]

    # -- engines to replace -----------------------------------------------------------------
    def condemn(self, ranks, why: str) -> None:
        """Take these ranks' engines out of use; they are replaced before the next call."""
        for r in ranks:
            self._condemned.setdefault(r, why)

    def taint(self, rank: int, why: str) -> None:
        """Replace this rank's engine before the next call; it may still be used until then."""
        self._tainted[rank] = why

    def live(self) -> list[int]:
        """Ranks whose engine is still in use (not condemned)."""
        return [r for r in range(self.world) if r not in self._condemned]

    def to_replace(self) -> dict[int, str]:
        """rank -> why, for every engine to replace before the next call, in rank order."""
        marked = dict(self._condemned)
        for r, why in self._tainted.items():
            marked.setdefault(r, why)
        return dict(sorted(marked.items()))

    def replace(self, ranks: list[int]) -> None:
        """Kill the engines of `ranks` and start new ones in their places, on their hosts where the
        launcher lets the Lab choose (clusters this Lab started). The world must be set up again
        afterwards (setup)."""
        if not self.local or self.cluster is None:
            raise LabError(
                f"the engines of ranks {ranks} must be restarted, and this Lab is connected to a cluster "
                "it did not start: restart them with ipcluster and call Lab.connect again"
            )
        self._end(ranks)
        hosts = [self.hosts[r] for r in ranks]
        try:
            more = self.started.more_engines(hosts) if self.started else {}
            self.cluster.start_engines_sync(n=len(ranks), **more)
            fresh = self._new_engines(len(ranks))
        except Exception as e:
            raise LabError(f"could not start new engines on {sorted(set(hosts))} for ranks {ranks}: {e}") from e
        self.watch_jobs()
        # each new engine takes a replaced rank's place: rank numbers never move
        for r, eid in zip(ranks, fresh):
            self.ids[r] = eid
            self._condemned.pop(r, None)
            self._tainted.pop(r, None)

    def restart(self) -> None:
        """Replace every engine and build the world again (clusters this Lab started)."""
        if not self.local or self.cluster is None:
            raise LabError(
                "this Lab is connected to a cluster it did not start; restart its engines "
                "with ipcluster and call Lab.connect again"
            )
        self._end(range(self.world))
        # on a loop and thread of its own, finished there (launchers.drained: the _sync wrappers hung)
        launchers.drained(self.cluster.stop_engines)
        self.cluster.start_engines_sync(n=self._n)
        self.watch_jobs()
        self.ids = self._new_engines(self._n)
        self._condemned.clear()
        self._tainted.clear()
        self.setup()

    def _end(self, ranks) -> None:
        """Kill these ranks' engines: by pid on this machine, else by asking the controller."""
        procs, elsewhere = [], []
        for r in ranks:
            if r >= len(self.pids):
                continue
            if not self.here[r]:
                elsewhere.append(self.ids[r])
                continue
            try:
                # SIGKILL: a rank stuck inside a collective never gets back to Python to handle a gentler signal
                os.kill(self.pids[r], signal.SIGKILL)
                procs.append(psutil.Process(self.pids[r]))
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        if elsewhere:
            try:
                self.client.shutdown(targets=[e for e in elsewhere if e in self.client.ids], block=False)
            except Exception:  # already gone
                pass
        psutil.wait_procs(procs, timeout=10)

    def watch_jobs(self) -> None:
        """Tell the watchdog how to cancel the scheduler jobs started so far, and which batch
        script to remove (if the kernel dies)."""
        if self.started is not None and self.watchdog is not None:
            for cmd in self.started.cancel_commands(self.cluster):
                self.watchdog.cancel_on_death(cmd)
                self.watchdog.remove_on_death(launchers.batch_file(self.cluster))

    def processes(self) -> list[psutil.Process]:
        """Every process on this machine that this Lab started and that is still there."""
        return watchdog.tagged(self.watchdog.token) if self.watchdog is not None else []

    def _new_engines(self, n: int) -> list[int]:
        end = time.monotonic() + REPLACE_WAIT_S
        while time.monotonic() < end:
            # ids never seen before: the controller numbers new engines on from the old ones
            fresh = sorted(set(self.client.ids) - self._known_ids)
            if len(fresh) >= n:
                self._known_ids |= set(fresh)
                return fresh[:n]
            time.sleep(0.1)
        raise LabError(f"{n} new engine(s) did not register within {REPLACE_WAIT_S:g} s")

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, wait: float = 10.0) -> None:
        """Stop the engines and controller of a local cluster, or take down the world on a shared
        one and disconnect. Waits at most `wait` seconds for whoever holds the lock."""
        got = self.lock.acquire(timeout=wait)
        try:
            if not self.local:
                try:
                    self.each(process_group.shutdown_distributed, range(self.world), bound=10.0)
                except Exception:
                    pass
            try:
                self.client.close()
            except Exception:
                pass
            if self.local and self.cluster is not None:
                launchers.stop(self.cluster)
                self.cluster = None
            if self.watchdog is not None:  # sweeps what the cluster's stop left behind
                self.watchdog.close()
        finally:
            if got:
                self.lock.release()
