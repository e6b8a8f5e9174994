"""The launcher, GPU and host decisions as plain functions (no cluster): what each launcher is told,
which GPUs a classroom Lab takes from a made-up nvidia-smi table, rank order and interfaces per host."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from labkit import ConfigError
from labkit.cluster.errors import LabError
from labkit.cluster.gpus import Gpu, gpu_problems, parse_smi, pick, visible_devices
from labkit.cluster.launchers import (
    CONTROLLER_MISSES,
    HEARTBEAT_MISSES,
    HEARTBEAT_MS,
    START_TIMEOUT_S,
    TAG,
    ForkedEngines,
    MPIEngines,
    Started,
    cluster_settings,
    default_route_address,
    launcher_problems,
    mpi_args,
    slurm_script,
)
from labkit.cluster.world import host_order, watchable, world_setup

GIB = 2**30


def test_every_launcher_gets_the_tag_one_listening_address_and_threads_for_schedulers():
    for launcher, options in (
        ("local", {}),
        ("mpi", {}),
        ("slurm", {"controller_ip": "127.0.0.1"}),
        ("ssh", {"hosts": {"n1": 2}, "controller_ip": "10.1.2.3"}),
    ):
        kwargs, c = cluster_settings(launcher, 2, "t0k", options, {"CUDA_VISIBLE_DEVICES": "1"})
        assert c.BaseLauncher.environment == {TAG: "t0k", "CUDA_VISIBLE_DEVICES": "1"}
        assert kwargs["controller_ip"] not in ("", "0.0.0.0", "*")
        assert "--IPController.use_threads=True" in kwargs["controller_args"]
        assert f"--IPEngine.max_heartbeat_misses={HEARTBEAT_MISSES}" in c.EngineLauncher.engine_args
        assert f"--IPEngine.timeout={START_TIMEOUT_S:g}" in c.EngineLauncher.engine_args  # the Lab's bound
        assert f"--HeartMonitor.period={HEARTBEAT_MS}" in kwargs["controller_args"]
        assert f"--HeartMonitor.max_heartmonitor_misses={CONTROLLER_MISSES}" in kwargs["controller_args"]
        nanny_off = "--IPEngine.enable_nanny=False" in c.EngineLauncher.engine_args
        assert nanny_off == (launcher == "local")  # remote engines keep theirs: it reports their death at once
        # local engines: forked from one process that imported torch once (tests/test_lab.py starts them)
        assert (kwargs["engines"] is ForkedEngines) == (launcher == "local")
    # a faster ping, the same times: an engine alone exits after ~14 s (it checks every period + 500 ms,
    # ipyparallel's engine), the controller drops a silent engine after 30 s (ipyparallel's 10 x 3 s)
    assert 13.0 <= HEARTBEAT_MISSES * (HEARTBEAT_MS + 500) / 1000 <= 15.0
    assert CONTROLLER_MISSES * HEARTBEAT_MS / 1000 == 10 * 3.0
    assert cluster_settings("local", 2, "t", {})[0]["controller_ip"] == "127.0.0.1"
    assert cluster_settings("mpi", 2, "t", {})[0]["controller_ip"] == "127.0.0.1"  # mpiexec here, no hosts


def test_the_controller_binds_the_default_route_interface_when_engines_may_be_elsewhere(tmp_path):
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway\tFlags\n"
        "lo\t0000007F\t00000000\t0001\n"  # not a default route
        "lo\t00000000\t0100007F\t0003\n"
    )
    assert default_route_address(str(table)) == "127.0.0.1"  # the interface of the 00000000 line
    table.write_text("Iface\tDestination\tGateway\tFlags\n")
    with pytest.raises(ValueError, match="controller_ip= or interface="):
        default_route_address(str(table))


def test_mpi_is_told_hosts_and_root_and_runs_no_mpi_inside_the_engines():
    kwargs, c = cluster_settings("mpi", 4, "t", {"hosts": {"a": 2, "b": 2}, "oversubscribe": True, "mpiexec": "mpirun"})
    assert kwargs["engines"] is MPIEngines
    assert c.MPILauncher.mpi_args == ["--host", "a:2,b:2", "--oversubscribe"]
    assert c.MPILauncher.mpi_cmd == ["mpirun"]
    launcher = MPIEngines(config=c, profile_dir="/tmp", cluster_id="x")
    launcher.n = 4
    assert "--mpi" not in launcher.find_args()  # no mpi4py needed on the engines
    assert launcher.find_args()[:4] == ["mpirun", "-n", "4", "--host"]
    assert mpi_args({"hostfile": "/etc/hosts.mpi", "mpi_args": ["--bind-to", "none"]}) == [
        "--hostfile",
        "/etc/hosts.mpi",
        "--bind-to",
        "none",
    ]


def test_the_slurm_script_carries_what_a_slurm_user_sets():
    script = slurm_script(
        {"partition": "gpu", "time": "1:00:00", "account": "proj42", "gpus_per_task": 1, "sbatch_options": ["--mem=8G"]}
    )
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh" and lines[-1] == "srun {program_and_args}"
    for want in (
        "#SBATCH --ntasks={n}",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1:00:00",
        "#SBATCH --account=proj42",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --mem=8G",
        "#SBATCH --export=ALL",  # the engines inherit the Lab's tag (and the interface variables)
    ):
        assert want in lines
    assert "--qos" not in script and "--nodes" not in script  # only what was asked
    _, c = cluster_settings("slurm", 2, "t", {"partition": "gpu", "controller_ip": "127.0.0.1"})
    assert c.SlurmEngineSetLauncher.batch_template == slurm_script({"partition": "gpu"})


def test_ssh_engines_per_host_and_replacements_on_the_same_host():
    _, c = cluster_settings(
        "ssh", 4, "t", {"hosts": {"a": 2, "b": 2}, "python": "/opt/py", "controller_ip": "10.0.0.1"}
    )
    assert c.SSHEngineSetLauncher.engines == {"a": 2, "b": 2}
    assert c.SSHLauncher.remote_python == "/opt/py" and c.SSHEngineLauncher.to_send == []
    started = Started("ssh", {"hosts": {"a.example": 2, "b": 2}})
    assert started.more_engines(["b", "a", "b"]) == {"engines": {"b": 2, "a.example": 1}}  # short names match
    with pytest.raises(ValueError, match="not among the ssh hosts"):
        started.more_engines(["c"])
    assert Started("slurm", {}).more_engines(["x"]) == {}


def test_launcher_choices_are_refused_with_a_fix():
    assert launcher_problems("pbs", 2, {}) == [
        "launcher='pbs' is not one of ['local', 'mpi', 'slurm', 'ssh']; try 'local'"
    ]
    (msg,) = launcher_problems("local", 2, {"partition": "gpu"})
    assert "partition=... is not an option of launcher='local'" in msg
    assert any("needs hosts=" in m for m in launcher_problems("ssh", 2, {}))
    assert any("has room for 2" in m for m in launcher_problems("ssh", 4, {"hosts": {"a": 1, "b": 1}}))
    assert any("hosts= or hostfile=" in m for m in launcher_problems("mpi", 2, {"hosts": {"a": 2}, "hostfile": "f"}))
    assert any("list of strings" in m for m in launcher_problems("mpi", 2, {"mpi_args": "--oversubscribe"}))
    assert launcher_problems("slurm", 2, {"partition": "gpu", "time": "10", "account": "x", "interface": "eth0"}) == []


def test_the_lab_refuses_bad_launcher_and_gpu_choices_before_starting_anything():
    from labkit import Lab

    with pytest.raises(ConfigError) as err:
        Lab(engines=2, launcher="local", partition="gpu", gpus=[0, 0], gpu_memory_fraction=1.5)
    text = str(err.value)
    assert "partition=" in text and "names a GPU twice" in text and "gpu_memory_fraction=1.5" in text
    with pytest.raises(ConfigError, match="ask the scheduler instead"):
        Lab(engines=2, launcher="slurm", gpus="auto")


TABLE = [
    Gpu(0, "GPU-a", 80 * GIB, 70 * GIB, 3),
    Gpu(1, "GPU-b", 80 * GIB, 2 * GIB, 1),
    Gpu(2, "GPU-c", 80 * GIB, 2 * GIB, 0),
    Gpu(3, "GPU-d", 80 * GIB, 40 * GIB, 1),
]


def test_auto_takes_the_gpus_with_the_most_free_memory_then_the_fewest_processes():
    assert [g.index for g in pick(TABLE, 2)] == [2, 1]  # equal free memory: fewer processes first
    assert [g.index for g in pick(TABLE, 3)] == [2, 1, 3]
    with pytest.raises(LabError, match="the machine has 4"):
        pick(TABLE, 5)
    assert visible_devices("auto", 4, None, TABLE, {}) == "GPU-c,GPU-b,GPU-d,GPU-a"
    assert visible_devices("auto", 4, 2, TABLE, {}) == "GPU-c,GPU-b"  # two ranks per GPU: two GPUs
    assert visible_devices([3, 1], 4, None, TABLE, {}) == "3,1"
    assert visible_devices(None, 4, None, TABLE, {}) is None


def test_a_kernel_given_some_gpus_chooses_among_those_only():
    """A classroom's spawner gives each student's kernel its GPUs (CUDA_VISIBLE_DEVICES): 'auto' and a
    list choose among them, and an index past them is refused with the fix (labkit/cluster/share.py)."""
    student = {"CUDA_VISIBLE_DEVICES": "GPU-a,3"}  # by UUID and by index, as CUDA accepts both
    assert visible_devices("auto", 2, None, TABLE, student) == "GPU-d,GPU-a"  # GPU-c is freer, not theirs
    assert visible_devices("auto", 2, 2, TABLE, student) == "GPU-d"
    assert visible_devices([1, 0], 2, None, TABLE, student) == "3,GPU-a"  # indices among the student's
    with pytest.raises(LabError, match=r"sees 2 GPU\(s\) .*GPU-a,3.*indices 0\.\.1"):
        visible_devices([2], 2, None, TABLE, student)
    with pytest.raises(LabError, match="this kernel may use 0"):
        visible_devices("auto", 1, None, TABLE, {"CUDA_VISIBLE_DEVICES": ""})  # none given: none to take


def test_nvidia_smi_output_is_read_into_the_table():
    gpus_csv = "0, GPU-a, 81559, 71000\n1, GPU-b, 81559, 1200\n"
    apps_csv = "GPU-a, 4242\nGPU-a, 4243\nGPU-b, 999\n"
    table = parse_smi(gpus_csv, apps_csv)
    assert table == [Gpu(0, "GPU-a", 81559 * 2**20, 71000 * 2**20, 2), Gpu(1, "GPU-b", 81559 * 2**20, 1200 * 2**20, 1)]
    assert parse_smi("", "") == []


def test_gpu_problems_name_a_fix():
    assert gpu_problems(None, "local", None, None) == []
    assert gpu_problems("auto", "local", 2, 0.25) == []
    assert gpu_problems([1, "GPU-x"], "local", None, 1) == []
    assert any("positive whole number" in m for m in gpu_problems("auto", "local", 0, None))
    assert any("goes with gpus='auto'" in m for m in gpu_problems([0], "local", 2, None))
    assert any("list of GPU indices" in m for m in gpu_problems("all", "local", None, None))
    assert any("ask the scheduler" in m for m in gpu_problems([0], "mpi", None, None))


def _info(host, rank=None, ifname="eth0", addr="10.0.0.9", boot="b1", ns="pid:[1]"):
    return {
        "host": host,
        "addr": addr,
        "gpus": 0,
        "cpus": 8,
        "route_addr": addr,
        "route_ifname": ifname,
        "launcher_rank": rank,
        "boot_id": boot,
        "pid_ns": ns,
    }


def test_ranks_go_host_by_host_in_the_launchers_order():
    infos = [_info("b", 3), _info("a", 1), _info("b", 2), _info("a", 0)]
    assert host_order(infos) == [2, 0, 3, 1]  # host b first (seen first), each host by launcher rank
    plain = [_info("x"), _info("y"), _info("x"), _info("y")]
    assert host_order(plain) == [0, 2, 1, 3]  # no launcher rank: registration order within a host


def test_each_host_talks_on_the_interface_that_reaches_the_controller():
    infos = [_info("a", ifname="lk21a0", addr="10.213.0.1")] * 2 + [_info("b", ifname="lk21b0", addr="10.213.0.2")] * 2
    world = world_setup(infos, local=True)
    assert world.addr == "10.213.0.1" and not world.loopback
    assert world.ifnames == ["lk21a0", "lk21a0", "lk21b0", "lk21b0"]
    one = world_setup([_info("a")] * 2, local=True)
    assert one.loopback and one.ifnames == ["lo", "lo"] and one.addr == "127.0.0.1"


def test_an_engine_is_watched_by_pid_only_on_this_machine_and_pid_namespace():
    mine = _info("a")
    assert watchable(_info("b"), mine)  # another host name (a UTS namespace), same kernel: its pid is ours to see
    assert not watchable(_info("a", boot="b2"), mine)
    assert not watchable(_info("a", ns="pid:[2]"), mine)
    assert not watchable({"host": "old"}, mine)  # an engine that does not say: by registration


class _StopsBadly:
    """A Cluster whose stop is two parts under asyncio.gather, as ipyparallel's: one raises at once
    (a host ssh cannot reach), the other is inside an SSHLauncher.join-like thread pool when it does."""

    shutdown_atexit = True
    profile_dir, cluster_id = "/nonexistent", "test"

    def __init__(self):
        self.finished_in: int | None = None

    async def _join(self):
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                await asyncio.wrap_future(pool.submit(time.sleep, 0.1))
                await asyncio.sleep(30)
        finally:
            self.finished_in = threading.get_ident()

    async def _unreachable(self):
        await asyncio.sleep(0.01)
        raise RuntimeError("ssh: connect to host labkit-b: No route to host")

    async def stop_cluster(self):
        await asyncio.gather(self._join(), self._unreachable())

    def stop_cluster_sync(self):  # ipyparallel's wrapper, outside a running loop
        from ipyparallel._async import _asyncio_run

        return _asyncio_run(self.stop_cluster())


def test_a_stop_finishes_what_it_leaves_running_before_it_returns():
    """ipyparallel's _sync wrapper returns with the join still pending, for the garbage collector
    to close in any thread (one that holds threading's _shutdown_locks_lock then deadlocks the
    process: launchers.drained). launchers.stop cancels and finishes it first, in its own thread."""
    from labkit.cluster import launchers

    cluster = _StopsBadly()
    launchers.stop(cluster)
    assert cluster.finished_in is not None and cluster.finished_in != threading.get_ident()
    assert cluster.shutdown_atexit is False
    with pytest.raises(RuntimeError, match="No route to host"):
        launchers.drained(_StopsBadly().stop_cluster)
