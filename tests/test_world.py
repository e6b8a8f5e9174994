"""How a Lab lays out its world (labkit/cluster/world.py), decided from engine infos made up for machines
this one is not: two hosts, eight GPUs, one GPU per engine. Pure: no cluster, no GPU."""

from __future__ import annotations

import json
import os
import re

import pytest

from labkit import ParallelConfig
from labkit.cluster.errors import LabError
from labkit.cluster.share import describe, ranges, share_rows
from labkit.cluster.world import backend_problems, forwarded_env, own_gpus, world_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engines(hosts: dict[str, int], gpus: int = 0, uuids=None, addr: str = "10.0.0.{h}", cpus: int = 16) -> list[dict]:
    """Infos of engines on `hosts` (name -> engines there), each seeing `gpus` GPUs whose UUIDs
    are uuids(host index, engine index on the host) (a list), or none reported."""
    out = []
    for h, (host, n) in enumerate(hosts.items()):
        for k in range(n):
            out.append(
                {
                    "host": host,
                    "pid": 1000 * h + k,
                    "addr": addr.format(h=h + 1),
                    "addrs": [f"10.0.0.{h + 1}"],
                    "gpus": gpus,
                    "gpu_uuids": uuids(h, k) if uuids else [],
                    "cpus": cpus,
                }
            )
    return out


def per_engine_gpu(h, k):  # srun --gpus-per-task=1: each engine sees one GPU, its own
    return [f"GPU-{h}-{k}"]


def whole_node(h, k):  # every engine sees its node's 8 GPUs
    return [f"GPU-{h}-{g}" for g in range(8)]


def test_one_gpu_per_engine_is_judged_by_physical_gpu_not_by_count():
    """Two nodes, 8 engines each, every engine bound to its own GPU (CUDA_VISIBLE_DEVICES=k):
    each sees 1 GPU for 8 engines per host, and they are 16 different GPUs."""
    infos = engines({"node0": 8, "node1": 8}, gpus=1, uuids=per_engine_gpu)
    world = world_setup(infos, local=False)
    assert world.backend == "nccl"
    assert world.devices == ["cuda:0"] * 16
    assert world.addr == "10.0.0.1" and not world.loopback
    assert world.threads == [2] * 16  # 16 CPUs per host for 8 engines


def test_engines_sharing_one_gpu_on_nccl_2_30_get_nccl_with_the_flag():
    """NCCL >= 2.30 runs several ranks on one GPU (NCCL_MULTI_RANK_GPU_ENABLE): auto takes it for
    up to two ranks a GPU, as NCCL's docs promise for the default configuration; backend='nccl'
    asks for more on purpose; one engine on an older NCCL rules it out."""
    one_gpu = lambda n, v: [dict(i, nccl=v) for i in engines({"box": n}, gpus=1, uuids=lambda h, k: ["GPU-0"])]
    two = world_setup(one_gpu(2, "2.30.7"), device="cuda")
    assert (two.backend, two.devices) == ("nccl", ["cuda:0", "cuda:0"])
    assert two.env == {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "4"} and "2.30.7" in two.why
    assert world_setup(one_gpu(2, "2.30.7")).devices == ["cpu", "cpu"]  # device='auto' with shared GPUs: the CPU
    four = world_setup(one_gpu(4, "2.31.2"), device="cuda")
    assert four.backend == "gloo" and "4 ranks on one GPU: NCCL runs up to 2" in four.why
    assert world_setup(one_gpu(4, "2.31.2"), backend="nccl").backend == "nccl"
    mixed = one_gpu(2, "2.30.7")
    mixed[1]["nccl"] = "2.29.7"
    assert world_setup(mixed, device="cuda").backend == "gloo"
    # four engines over two GPUs: two a GPU, round-robin
    pairs = [dict(i, nccl="2.30.7") for i in engines({"box": 4}, gpus=2, uuids=lambda h, k: ["GPU-0", "GPU-1"])]
    world = world_setup(pairs, device="cuda")
    assert world.backend == "nccl" and world.devices == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_engines_that_see_the_whole_node_take_one_gpu_each():
    world = world_setup(engines({"node0": 8}, gpus=8, uuids=whole_node), local=True)
    assert world.backend == "nccl" and world.devices == [f"cuda:{k}" for k in range(8)]
    assert world.addr == "127.0.0.1" and world.loopback
    # without UUIDs the engines are taken to see the same GPUs in the same order
    assert world_setup(engines({"node0": 8}, gpus=8), local=True).devices == [f"cuda:{k}" for k in range(8)]


def test_engines_sharing_one_gpu_on_an_old_nccl_get_gloo_and_nccl_is_refused():
    same = [dict(i, nccl="2.28.9") for i in engines({"box": 2}, gpus=1, uuids=lambda h, k: ["GPU-only"])]
    assert own_gpus(same) is None
    auto = world_setup(same)
    assert (auto.backend, auto.devices) == ("gloo", ["cpu", "cpu"])
    shared = world_setup(same, device="cuda")  # a classroom on one GPU: gloo on CUDA tensors
    assert (shared.backend, shared.devices) == ("gloo", ["cuda:0", "cuda:0"])
    assert shared.env == {} and "NCCL 2.28.9 cannot run two ranks on one GPU" in shared.why
    with pytest.raises(LabError, match=r"NCCL 2.28.9 cannot run two ranks on one GPU \(NCCL >= 2.30"):
        world_setup(same, backend="nccl")
    # counts alone cannot tell one-GPU-per-engine from one shared GPU: without UUIDs, gloo
    assert world_setup(engines({"box": 2}, gpus=1)).backend == "gloo"
    with pytest.raises(LabError, match="device='cuda' but the engines see"):
        world_setup(engines({"box": 2}, gpus=0), device="cuda")


def test_device_auto_picks_nccl_only_where_asked_and_cpu_stays_cpu():
    """A CPU notebook on a GPU server says device='cpu' and gets gloo on the CPU; 'auto' is NCCL
    there (what the README says), where collectives take CUDA tensors only."""
    infos = engines({"gpu-server": 4}, gpus=4, uuids=lambda h, k: [f"GPU-{g}" for g in range(4)])
    assert world_setup(infos, device="cpu").backend == "gloo"
    assert world_setup(infos, device="cpu").devices == ["cpu"] * 4
    assert world_setup(infos, device="auto").backend == "nccl"
    assert world_setup(infos, backend="gloo", device="cuda").devices == [f"cuda:{k}" for k in range(4)]


def test_a_loopback_rendezvous_across_hosts_is_refused_with_the_fix():
    """Debian and Ubuntu map the host name to 127.0.1.1: the other host cannot reach rank 0 there."""
    infos = engines({"a": 1, "b": 1}, addr="127.0.1.1")
    with pytest.raises(LabError, match=r"127\.0\.1\.1 .*loopback.*master_addr=.*10\.0\.0\.1"):
        world_setup(infos, local=False)
    assert world_setup(infos, local=False, master_addr="192.168.1.7").addr == "192.168.1.7"
    with pytest.raises(LabError, match="loopback"):
        world_setup(infos, local=False, master_addr="127.0.0.1")
    # one host: its own loopback address is fine, connected or not
    assert world_setup(engines({"a": 2}, addr="127.0.1.1"), local=False).addr == "127.0.1.1"


def test_threads_follow_each_hosts_own_cpus():
    infos = engines({"big": 2}, cpus=64) + engines({"small": 2}, cpus=8)
    assert world_setup(infos, local=False).threads == [32, 32, 4, 4]
    assert world_setup([dict(i, cpus=None) for i in infos], local=False, default_cpus=6).threads == [3, 3, 3, 3]


def test_a_labs_engines_share_the_cores_its_kernel_may_use():
    """The rule of labkit/cluster/share.py: a 64-CPU host, a kernel pinned to cores 4-5 (a classroom
    spawner's share for its student): two engines get one thread each, not 32; a quota (cgroup
    cpu.max) or JupyterHub's CPU_LIMIT narrower than the affinity caps it; the Lab's repr says which."""
    pinned = [dict(i, cores=[4, 5], cpu_quota=None, cpu_limit=None) for i in engines({"gpu-server": 2}, cpus=64)]
    world = world_setup(pinned)
    assert world.threads == [1, 1]
    assert describe(share_rows(pinned, world.threads, world.devices, None)) == (
        "cores 4-5 (CPU affinity): 1 thread(s) x 2 engines"
    )
    wide = [dict(i, cores=list(range(64))) for i in pinned]
    assert world_setup(wide).threads == [32, 32]
    quota = [dict(i, cpu_quota=8.0) for i in wide]
    assert world_setup(quota).threads == [4, 4]
    assert share_rows(quota, [4, 4], ["cpu"] * 2, None)[0]["limited by"] == "cgroup quota 8"
    assert world_setup([dict(i, cpu_limit=1.5) for i in wide]).threads == [1, 1]  # 1.5 CPUs: one thread
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_nccl_and_gloo_interface_settings_are_forwarded_to_the_engines():
    env = {
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "GLOO_SOCKET_IFNAME": "eth0",
        "PATH": "/bin",
        "MY_NCCL_NOTE": "x",
    }
    assert forwarded_env(env) == {k: env[k] for k in list(env)[:4]}


def test_torch_pipelining_on_shared_gpus_is_refused_with_the_reason():
    cfg = ParallelConfig(pp=2, microbatches=2, impl="torch")
    assert (
        backend_problems(cfg, "gloo", ["cuda:0", "cuda:0"]) and "gloo" in backend_problems(cfg, "gloo", ["cuda:0"])[0]
    )
    assert backend_problems(cfg, "gloo", ["cpu", "cpu"]) == []
    assert backend_problems(cfg, "nccl", ["cuda:0", "cuda:1"]) == []
    assert backend_problems(cfg.replace(impl="lab"), "gloo", ["cuda:0", "cuda:0"]) == []  # ours is staged


def test_engine_info_reports_what_the_decision_reads():
    from labkit.engines.host import engine_info

    info = engine_info()
    assert {"host", "addr", "addrs", "gpus", "gpu_uuids", "cpus", "cores", "cpu_quota", "cpu_limit"} <= set(info)
    assert len(info["gpu_uuids"]) == info["gpus"] and info["cpus"] >= 1
    assert info["cores"] == sorted(os.sched_getaffinity(0))  # the CPUs this process may run on
    if info["addrs"]:  # a host with a network interface up gives one of its own, not 127.0.1.1
        assert not info["addr"].startswith("127.")


def _lab_calls(text: str) -> list[str]:
    code = re.sub(r"#.*", "", text)  # comments mention `with Lab(...) as lab:`
    return re.findall(r"\bLab\((?:[^()]|\([^()]*\))*\)", code)


def test_cpu_fixtures_and_notebooks_ask_for_the_cpu():
    """device='auto' would make them NCCL worlds on a host with a GPU per engine, and they build
    CPU tensors: each says device='cpu'."""
    sources = {"tests/conftest.py": open(os.path.join(ROOT, "tests", "conftest.py")).read()}
    nb_dir = os.path.join(ROOT, "notebooks")
    for name in sorted(os.listdir(nb_dir)):
        if name.endswith(".ipynb"):
            nb = json.load(open(os.path.join(nb_dir, name)))
            code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
            sources[f"notebooks/{name}"] = code
    calls = {where: _lab_calls(text) for where, text in sources.items()}
    assert calls["tests/conftest.py"] and sum(len(c) for c in calls.values()) >= 12
    for where, found in calls.items():
        for call in found:
            assert "device=" in call, f"{where}: {call}"
