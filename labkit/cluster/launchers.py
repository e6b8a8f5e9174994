"""How a Lab starts its cluster: ipyparallel's own launchers, with the options a user of each expects.

    Lab(engines=4)                                                   # 'local': processes on this machine
    Lab(engines=8, launcher="slurm", partition="gpu", time="1:00:00", account="proj42")
    Lab(engines=8, launcher="mpi", hosts={"node1": 4, "node2": 4})   # mpiexec starts the engines
    Lab(engines=8, launcher="ssh", hosts={"node1": 4, "node2": 4})   # ssh starts them, per host

What every Lab's cluster gets (`cluster_settings`):
  - the controller listens on one address, never on all of them: `controller_ip`, else the
    address of `interface`, else 127.0.0.1 when every engine runs on this machine ('local', 'mpi'
    without hosts), else the address of this machine's default-route interface (the one other
    nodes reach). Engines and the notebook talk to it with ipyparallel's HMAC-signed messages;
  - the controller's schedulers are threads of its process (ipyparallel starts each as a process
    otherwise: seven more Python processes, ~60 MiB each);
  - a local Lab's engines are forked from one process that has imported torch once (ForkedEngines,
    labkit/cluster/forked.py), where ipyparallel's local launcher starts an interpreter per engine;
  - a local Lab's engines run without ipyparallel's nanny (a process per engine that relays
    signals; the Lab never signals an engine and sees a local engine die by its pid);
  - every process carries the Lab's tag (`TAG`) in its environment: the watchdog
    (labkit/cluster/watchdog.py) ends whatever carries it when the kernel dies, and runs the scheduler's
    cancel command; engines on other hosts exit by themselves once the controller is gone, after
    HEARTBEAT_MISSES missed heartbeats, ~14 s (ipyparallel's default is 50, about three minutes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field

import psutil
from ipyparallel.cluster.launcher import EngineLauncher, LocalProcessLauncher, MPIEngineSetLauncher
from traitlets import Dict
from traitlets.config import Config

from labkit.cluster.forked import MODULE

LAUNCHERS = ("local", "mpi", "slurm", "ssh")
COMMON = ("controller_ip", "interface")
OPTIONS = {
    "local": (),
    "mpi": ("hosts", "hostfile", "mpi_args", "oversubscribe", "mpiexec"),
    "slurm": ("partition", "time", "account", "qos", "nodes", "gpus_per_task", "sbatch_options"),
    "ssh": ("hosts", "python", "ssh_cmd", "ssh_args", "scp_cmd"),
}
"""The options each launcher takes (besides COMMON), as Lab(..., **options)."""
TAG = "LABKIT_LAB"
"""The environment variable that marks every process a Lab starts (its value: the Lab's token)."""
HEARTBEAT_MS = 500
"""How often the controller pings its engines (ipyparallel's HeartMonitor.period; its default is 3,000). A
new engine counts as registered at the first ping it answers, so a Lab's start waited up to one period
after its last engine had registered (a 4-engine Lab's start: 9.4 s at 3,000, 5.0 s at 500:
benchmarks/lab_start.py). The times that matter stay what they were: HEARTBEAT_MISSES and CONTROLLER_MISSES."""
HEARTBEAT_MISSES = 14
"""An engine exits after this many missed controller heartbeats (it checks every HEARTBEAT_MS + 500 ms,
ipyparallel's rule: ~14 s): what ends an engine on another host when the kernel, and with it the
controller, is gone."""
CONTROLLER_MISSES = 60
"""The controller drops an engine that has not answered this many pings (60 x 0.5 s: the 30 s of
ipyparallel's defaults, 10 x 3 s); an engine's heart answers from a thread of its own, but a loaded
2-core machine may not run it for seconds."""
START_TIMEOUT_S = 120.0


class MPIEngines(MPIEngineSetLauncher):
    """Engines started by mpiexec, without MPI inside them: torch.distributed is their
    communication and mpiexec only the process starter, so ipyparallel's `--mpi` (which needs
    mpi4py in every engine) is left out."""

    @property
    def program(self):
        return self.engine_cmd


class ForkedEngines(LocalProcessLauncher, EngineLauncher):
    """A local Lab's engines: one process imports torch, ipyparallel's engine and labkit's engine code
    once and forks the n engines (labkit/cluster/forked.py), where ipyparallel's own local launcher
    starts n interpreters that each import them (~2 s of a core each). ipyparallel sees one process for
    the set, as with mpiexec; each engine keeps its own output file, under ipyparallel's name for it."""

    outputs = Dict()
    """Engine index (a str, as ipyparallel's engine sets key them) -> what it wrote, once read; 'set':
    what the set's own process wrote (before any fork: an import that failed)."""

    def start(self, n):
        self.n = n
        return super().start()

    def engine_output(self, i: int) -> str:
        return f"{self.engines_log}-{i}.log"

    @property
    def engines_log(self) -> str:
        return os.path.join(self.profile_dir, "log", f"ipengine-{self.cluster_id}-{self.engine_set_id}")

    def find_args(self):
        engine = self.engine_cmd[1:]  # ipyparallel's `python -m ipyparallel.engine`, less the interpreter
        forked = [sys.executable, "-m", MODULE, str(self.n), self.engines_log]
        return [*forked, *engine, *self.cluster_args, *self.engine_args]

    def get_output(self, remove=False):
        """What the set's process and each engine wrote, joined as ipyparallel's engine set joins its
        engines' (`outputs` keeps each)."""
        for i in range(self.n):
            try:
                with open(self.engine_output(i), errors="replace") as f:
                    self.outputs[str(i)] = f.read()
                if remove:
                    os.remove(self.engine_output(i))
            except OSError:  # removed at an earlier read: what that read found stays
                pass
        self.outputs["set"] = super().get_output(remove=remove)
        return "\n".join(f"Output for engine {k}\n{text}" for k, text in self.outputs.items() if text.strip())


def launcher_problems(launcher, engines, options: dict) -> list[str]:
    """What is wrong with a launcher choice and its options, each with a fix (ConfigError)."""
    if launcher not in LAUNCHERS:
        return [f"launcher={launcher!r} is not one of {list(LAUNCHERS)}; try 'local'"]
    allowed = set(OPTIONS[launcher]) | set(COMMON)
    bad = [
        f"{k}=... is not an option of launcher={launcher!r}; its options are {sorted(allowed)}"
        for k in sorted(set(options) - allowed)
    ]
    hosts = options.get("hosts")
    if launcher == "ssh" and not hosts:
        bad.append("launcher='ssh' needs hosts={'host': engines, ...}: where to start how many engines")
    if hosts is not None:
        if not isinstance(hosts, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in hosts.values()
        ):
            bad.append(f"hosts={hosts!r} must map each host name to a positive number of engines")
        elif isinstance(engines, int) and engines > sum(hosts.values()):
            bad.append(f"engines={engines} but hosts={hosts} has room for {sum(hosts.values())}; add hosts or slots")
    if launcher == "mpi" and hosts and options.get("hostfile"):
        bad.append("launcher='mpi' takes hosts= or hostfile=, not both")
    for key in ("mpi_args", "ssh_cmd", "ssh_args", "scp_cmd", "sbatch_options"):
        v = options.get(key)
        if v is not None and not (isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v)):
            bad.append(f"{key}={v!r} must be a list of strings")
    return bad


def engines_on_this_machine(launcher: str, options: dict) -> bool:
    """Whether every engine surely runs here (then the controller can stay on 127.0.0.1)."""
    return launcher == "local" or (launcher == "mpi" and not options.get("hosts") and not options.get("hostfile"))


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`."""
    for a in psutil.net_if_addrs().get(name, []):
        if a.family == socket.AF_INET:
            return a.address
    raise ValueError(f"interface={name!r} has no IPv4 address here; the interfaces are {sorted(psutil.net_if_addrs())}")


def default_route_address(route_table: str = "/proc/net/route") -> str:
    """The IPv4 address of the interface that holds the default route (where other nodes reach this one)."""
    with open(route_table) as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            # destination 0.0.0.0 (the table writes addresses in hex): the default route
            if len(fields) > 1 and fields[1] == "00000000":
                return interface_address(fields[0])
    raise ValueError("this machine has no default route; pass controller_ip= or interface=")


def controller_ip(launcher: str, options: dict) -> str:
    if options.get("controller_ip"):
        return options["controller_ip"]
    if options.get("interface"):
        return interface_address(options["interface"])
    return "127.0.0.1" if engines_on_this_machine(launcher, options) else default_route_address()


def slurm_script(options: dict) -> str:
    """The sbatch script for the engines (ipyparallel fills {n}, {cluster_id}, {output_file}, {program_and_args})."""
    lines = [
        "#!/bin/sh",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=labkit-{cluster_id}",
        "#SBATCH --ntasks={n}",
        "#SBATCH --output={output_file}",
    ]
    for key, flag in (
        ("partition", "--partition"),
        ("time", "--time"),
        ("account", "--account"),
        ("qos", "--qos"),
        ("nodes", "--nodes"),
        ("gpus_per_task", "--gpus-per-task"),
    ):
        if options.get(key) is not None:
            lines.append(f"#SBATCH {flag}={options[key]}")
    lines += [f"#SBATCH {extra}" for extra in options.get("sbatch_options") or ()]
    # srun inside the allocation: one engine per task
    lines.append("srun {program_and_args}")
    return "\n".join(lines) + "\n"


def mpi_args(options: dict) -> list[str]:
    out = []
    if options.get("hosts"):
        # Open MPI's host:slots
        out += ["--host", ",".join(f"{h}:{n}" for h, n in options["hosts"].items())]
    if options.get("hostfile"):
        out += ["--hostfile", str(options["hostfile"])]
    if options.get("oversubscribe"):
        out.append("--oversubscribe")  # Open MPI: more engines than a host has cores
    return out + list(options.get("mpi_args") or ())


def cluster_settings(launcher: str, n: int, token: str, options: dict, env: dict | None = None) -> tuple[dict, Config]:
    """ipyparallel.Cluster's keyword arguments and config for `launcher` (pure: no process started).
    env: more variables for every process the Lab starts (the engines' CUDA_VISIBLE_DEVICES, ...)."""
    c = Config()
    c.BaseLauncher.environment = {TAG: token, **(env or {})}
    c.LocalProcessLauncher.stop_seconds_until_kill = 1  # an engine that outlives SIGTERM by 1 s is killed
    engine_args = [
        f"--IPEngine.max_heartbeat_misses={HEARTBEAT_MISSES}",
        # how long an engine waits for the hub's answer to its registration before it exits (ipyparallel:
        # 5 s, which a loaded machine's hub can miss: seen once at half CPU, an ssh engine gone while
        # its Lab started); the Lab's own bound on its start is the one that matters
        f"--IPEngine.timeout={START_TIMEOUT_S:g}",
    ]
    if launcher == "local":
        engine_args.append("--IPEngine.enable_nanny=False")
    c.EngineLauncher.engine_args = engine_args
    kwargs = dict(
        n=n,
        controller_ip=controller_ip(launcher, options),
        controller_args=[
            "--IPController.use_threads=True",
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={CONTROLLER_MISSES}",
        ],
        engine_timeout=int(START_TIMEOUT_S),
        # errors only: ipyparallel's info lines would fill the notebook's cells
        log_level=40,
        config=c,
    )
    if launcher == "local":
        # prctl and a fork after `import torch` (safe on Linux, as PyTorch's DataLoader does) are Linux's:
        # elsewhere an interpreter per engine, as ipyparallel starts them
        kwargs["engines"] = ForkedEngines if sys.platform.startswith("linux") else "local"
    elif launcher == "mpi":
        kwargs["engines"] = MPIEngines
        c.MPILauncher.mpi_cmd = [options.get("mpiexec") or "mpiexec"]
        c.MPILauncher.mpi_args = mpi_args(options)
        if os.geteuid() == 0:  # Open MPI refuses root unless told twice
            c.MPILauncher.environment = {
                TAG: token,
                **(env or {}),
                "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            }
    elif launcher == "slurm":
        kwargs["engines"] = "slurm"
        c.SlurmEngineSetLauncher.batch_template = slurm_script(options)
    elif launcher == "ssh":
        kwargs["engines"] = "ssh"
        c.SSHEngineSetLauncher.engines = dict(options["hosts"])
        c.SSHLauncher.remote_python = options.get("python") or sys.executable
        c.SSHLauncher.ssh_cmd = list(options.get("ssh_cmd") or ["ssh"])
        c.SSHLauncher.ssh_args = list(options.get("ssh_args") or [])
        c.SSHLauncher.scp_cmd = list(options.get("scp_cmd") or ["scp"])
        c.SSHEngineLauncher.to_send = []  # the engines get the connection info in their environment
    return kwargs, c


@dataclass
class Started:
    """A cluster this Lab started: which launcher, its options, and the commands that cancel its
    scheduler jobs (what the watchdog runs if the kernel dies)."""

    launcher: str
    options: dict
    cancels: list[list[str]] = field(default_factory=list)
    retries: list[str] = field(default_factory=list)
    """Each start tried again before this one, with the line that said which port was taken (port_taken)."""

    def cancel_commands(self, cluster) -> list[list[str]]:
        """The cancel commands of the cluster's batch jobs not yet known (scancel JOBID, ...)."""
        new = []
        for engine_set in cluster.engines.values():
            # only a batch launcher's engine set has a job id
            job = getattr(engine_set, "job_id", "")
            if job:
                cmd = [*engine_set.delete_command, str(job)]
                if cmd not in self.cancels:
                    self.cancels.append(cmd)
                    new.append(cmd)
        return new

    def more_engines(self, hosts: list[str]) -> dict:
        """start_engines' keyword arguments that put new engines where the engines of `hosts` were
        (ssh: on those hosts; the other launchers place them themselves)."""
        if self.launcher != "ssh":
            return {}
        known = self.options["hosts"]
        # an engine may report its host's short name where the options gave the full one, or the reverse
        short = {h.split(".")[0]: h for h in known}
        where = Counter()
        for h in hosts:
            name = h if h in known else short.get(h.split(".")[0])
            if name is None:
                raise ValueError(f"host {h!r} is not among the ssh hosts {sorted(known)}")
            where[name] += 1
        return {"engines": dict(where)}


def batch_file(cluster) -> str:
    """Where a batch launcher (Slurm, ...) writes its script: in the cluster's profile directory,
    one per cluster (an absolute batch_file_name wins over ipyparallel's work_dir '.')."""
    return os.path.join(cluster.profile_dir, f"labkit-{cluster.cluster_id}-engines.sbatch")


STOP_TIMEOUT_S = 120.0
"""How long a stop waits for the launchers (ssh to a host that is gone included) before it goes on."""


def drained(cluster_call) -> None:
    """Run `cluster_call()` (a coroutine of the Cluster: stop_cluster, stop_engines) to its end on
    an event loop of its own, in a thread of its own, and finish there whatever it leaves
    running; raise what it raised. Why not ipyparallel's `_sync` wrappers: their parts run under
    asyncio.gather, which leaves the others running when one raises (a host ssh cannot reach), and
    the wrapper closes its loop with them pending. The garbage collector then closes each one in
    whatever thread it collects in; an SSHLauncher.join closes its thread pool there and waits for
    it, and when that thread is inside threading's _shutdown_locks_lock (starting a thread) every
    later Thread.start in the process waits for ever (seen: a test session stuck in Lab.close)."""
    failed: list[BaseException] = []

    def body() -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(cluster_call())
        except Exception as e:
            failed.append(e)
        finally:
            # what the call left running is cancelled and finished here, before the loop closes: never
            # by the garbage collector in some other thread (the docstring's hang)
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.close()

    # its own thread: a notebook's thread already runs an event loop
    worker = threading.Thread(target=body, name="labkit-stop", daemon=True)
    worker.start()
    worker.join(STOP_TIMEOUT_S)
    if worker.is_alive():
        raise TimeoutError(f"the launchers did not stop within {STOP_TIMEOUT_S:g} s")
    if failed:
        raise failed[0]


def stop(cluster) -> None:
    try:
        drained(cluster.stop_cluster)
    except Exception:  # e.g. a host ssh cannot reach: its engines exit on missed heartbeats
        pass
    # stopped once: the Cluster's __del__ would try again (and raise at garbage collection)
    cluster.shutdown_atexit = False
    with contextlib.suppress(OSError):  # submitted already: sbatch keeps its own copy
        os.remove(batch_file(cluster))
