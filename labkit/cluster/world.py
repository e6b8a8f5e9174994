"""How a Lab lays out its torch world from what its engines report: the backend, each rank's
device, the rendezvous address and each rank's threads; and the environment the engines get.

Pure (plain dicts in, a WorldSetup out): EngineSet.setup calls `world_setup` with the engines'
`engine_info()`; tests call it with made-up infos for machines this one is not (two hosts, eight
GPUs, one GPU per engine). What it decides:
  - one GPU per engine is judged by physical GPU (UUIDs), not by counts: launchers that bind one
    GPU per task (`srun --gpus-per-task=1`, a CUDA_VISIBLE_DEVICES per engine) show every engine
    one GPU, and those GPUs are all different;
  - backend='auto' is NCCL when every engine has a GPU of its own and device is not 'cpu'; with
    device='cuda' and ranks sharing GPUs it is NCCL too where every engine's NCCL runs several
    ranks on one GPU (>= 2.30, at most NCCL_SHARED_RANKS a GPU; `shared_nccl_problem`), else gloo
    on CUDA tensors, and WorldSetup.why says which of those it was and why;
  - the rendezvous is 127.0.0.1 for a local cluster on one host; across hosts it is master_addr,
    or the address rank 0 reaches the controller from (its host's address on the cluster's
    network), or rank 0's address, which must not be a loopback one (Debian and Ubuntu map the
    hostname to 127.0.1.1), else the Lab says to pass master_addr;
  - each rank's network interface (GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME across hosts) is the
    one its own host reaches the controller through, so each host listens and talks on the cluster's
    network and nowhere else, whatever its interfaces are called ('lo' on one host);
  - ranks go host by host (`host_order`), so that neighbouring ranks, which the mesh gives to a
    tensor-parallel group, share a host.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

from labkit.cluster.errors import LabError
from labkit.cluster.share import usable_cores
from labkit.config import ParallelConfig

FORWARDED_PREFIXES = ("NCCL_", "TORCH_NCCL_")
FORWARDED_NAMES = ("GLOO_SOCKET_IFNAME",)
"""Environment variables the notebook's process passes on to the engines (the network interfaces
NCCL and gloo use, NCCL's tuning): a connected cluster's engines did not start from it."""


NCCL_SHARED_SINCE = (2, 30)
"""The NCCL that runs several ranks of one communicator on one GPU (NVIDIA/nccl src/init.cc,
docs/userguide env.rst 'NCCL_MULTI_RANK_GPU_ENABLE', since 2.30, experimental). Before it, a
communicator's init fails with 'Duplicate GPU detected'; from it, without the flag, with 'Multiple
Ranks are using the same GPU/Partition'."""

NCCL_SHARED_RANKS = 2
"""Ranks per GPU that backend='auto' puts on NCCL: 'with the default configuration, NCCL should be
able to run up to 2 ranks per GPU' (env.rst). backend='nccl' asks for more on purpose."""

NCCL_SHARED_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "4"}
"""What a world of ranks sharing GPUs on NCCL sets on its engines: the flag, and a cap on each rank's
channels (CTAs), since 'each rank sharing a GPU allocates its own set of channels ... failing to [fit]
will result in a hang' (env.rst, which asks users to set NCCL_MAX_CTAS). The notebook's own NCCL_*
variables, forwarded, win over these."""


def nccl_version(info: dict) -> tuple[int, ...] | None:
    """The NCCL an engine reported ('2.30.7' -> (2, 30, 7)); None if it has none."""
    text = info.get("nccl") or ""
    try:
        return tuple(int(x) for x in text.split(".")) if text else None
    except ValueError:
        return None


def shared_nccl_problem(infos: list[dict], devices: list[str], limit: int | None = NCCL_SHARED_RANKS) -> str | None:
    """Why ranks on `devices` (some sharing a GPU) cannot be one NCCL world, or None if they can:
    every engine's NCCL must be >= NCCL_SHARED_SINCE, and (with a limit) no GPU may hold more ranks."""
    # an engine with no NCCL counts as too old
    old = sorted({info.get("nccl") or "none" for info in infos if (nccl_version(info) or (0,)) < NCCL_SHARED_SINCE})
    if old:
        since = ".".join(map(str, NCCL_SHARED_SINCE))
        return (
            f"NCCL {', '.join(old)} cannot run two ranks on one GPU (NCCL >= {since} can, with "
            f"NCCL_MULTI_RANK_GPU_ENABLE=1; e.g. pip install 'nvidia-nccl-cu13>={since}')"
        )
    # ranks per physical GPU, by host and UUID: two engines may see one GPU under different indices
    per_gpu = Counter((info["host"], _gpu_id(info, d)) for info, d in zip(infos, devices))
    most = max(per_gpu.values())
    if limit is not None and most > limit:
        return (
            f"{most} ranks on one GPU: NCCL runs up to {limit} a GPU in its default configuration "
            f"(NCCL_MULTI_RANK_GPU_ENABLE, env.rst); pass backend='nccl' to try more"
        )
    return None


def _gpu_id(info: dict, device: str) -> str:
    k = int(device.split(":")[1])
    uuids = info.get("gpu_uuids") or []
    return uuids[k] if k < len(uuids) and uuids[k] else f"#{k}"


@dataclass(frozen=True)
class WorldSetup:
    backend: str
    """'gloo' or 'nccl'."""
    devices: list[str]
    """Per rank: 'cpu' or 'cuda:N' (N among the GPUs that rank's engine sees)."""
    addr: str
    """Where rank 0's TCPStore listens."""
    loopback: bool
    """Every rank on this host, local cluster: gloo's connections stay on 127.0.0.1 too."""
    threads: list[int]
    """Per rank: intra-op threads, the cores its engines may use shared among them (labkit/cluster/share.py)."""
    ifnames: list[str] | None = None
    """Per rank: the network interface its gloo (and NCCL, across hosts) sockets use; None: torch's choice."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables every engine sets before the world is built (NCCL_SHARED_ENV for ranks sharing GPUs on NCCL)."""
    why: str = ""
    """Why the backend is what it is, where that is not the plain rule (shared GPUs: NCCL, or gloo and why)."""


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name: whether it resolves to a loopback is the caller's to say
        return addr == "localhost"


def own_gpus(infos: list[dict]) -> list[int] | None:
    """Each rank's own GPU, an index among those its engine sees, so that no two ranks of a host
    share a physical GPU; None when there are not enough. Engines that report no UUIDs are taken
    to see all of their host's GPUs in the same order."""
    taken: dict[str, set] = {}
    out = []
    for info in infos:
        uuids = info.get("gpu_uuids") or []
        # no UUID for each GPU: the host's engines are taken to see its GPUs in one order
        if len(uuids) != info["gpus"] or not all(uuids):
            uuids = [f"{info['host']}#{k}" for k in range(info["gpus"])]
        used = taken.setdefault(info["host"], set())
        # the first GPU of the host that no rank took yet
        free = [k for k, u in enumerate(uuids) if u not in used]
        if not free:
            return None
        used.add(uuids[free[0]])
        out.append(free[0])
    return out


def world_setup(
    infos: list[dict],
    *,
    backend: str = "auto",
    device: str = "auto",
    local: bool = True,
    master_addr: str | None = None,
    default_cpus: int = 1,
) -> WorldSetup:
    """The world for engines reporting `infos` (runtime/host engine_info: host, addr, gpus,
    gpu_uuids, cpus, cores), in rank order. Raises LabError for a choice the engines cannot honour."""
    hosts = [i["host"] for i in infos]
    per_host = Counter(hosts)
    # each engine's index among its host's engines: which GPU it shares, round-robin
    local_index, seen = [], Counter()
    for h in hosts:
        local_index.append(seen[h])
        seen[h] += 1
    has_gpu = all(i["gpus"] > 0 for i in infos)
    if device == "cuda" and not has_gpu:
        raise LabError(f"device='cuda' but the engines see {[i['gpus'] for i in infos]} GPUs; use device='cpu'")
    own = own_gpus(infos) if has_gpu else None
    # a GPU of its own per rank: CUDA unless the CPU or gloo was asked for
    if own is not None and (device == "cuda" or (device == "auto" and backend != "gloo")):
        devices = [f"cuda:{k}" for k in own]
    elif has_gpu and (device == "cuda" or backend == "nccl"):  # shared GPUs: round-robin over what each sees
        devices = [f"cuda:{k % i['gpus']}" for k, i in zip(local_index, infos)]
    else:
        devices = ["cpu"] * len(infos)
    env, why = {}, ""
    shared = own is None and devices[0] != "cpu"
    if backend == "nccl" and not has_gpu:
        raise LabError(
            f"backend='nccl' needs a GPU for every engine; the engines see {[i['gpus'] for i in infos]} GPUs. "
            "Use backend='gloo' or 'auto'"
        )
    if shared and backend in ("auto", "nccl"):
        problem = shared_nccl_problem(infos, devices, NCCL_SHARED_RANKS if backend == "auto" else None)
        if problem is None:
            backend, env = "nccl", dict(NCCL_SHARED_ENV)
            why = f"ranks share GPUs: NCCL {infos[0].get('nccl')} with NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental)"
        elif backend == "nccl":
            raise LabError(f"backend='nccl' with {dict(per_host)} engines per host on shared GPUs: {problem}")
        else:
            backend, why = "gloo", f"ranks share GPUs and {problem}: gloo on CUDA tensors"
    elif backend == "auto":
        # the plain rule: NCCL where each rank has a GPU of its own, gloo otherwise
        backend = "nccl" if own is not None and device != "cpu" else "gloo"
    one_host = len(per_host) == 1
    loopback = local and one_host
    # across hosts rank 0's address as seen on the route to the controller: that network reaches them all
    addr = master_addr or ("127.0.0.1" if loopback else infos[0].get("route_addr") or infos[0]["addr"])
    if not one_host and is_loopback(addr):
        others = [a for a in infos[0].get("addrs") or [] if not is_loopback(a)]
        raise LabError(
            f"the rendezvous address {addr} (rank 0's host {hosts[0]}) is a loopback address, which the "
            f"engines on {sorted(set(hosts) - {hosts[0]})} cannot reach; pass master_addr='<an address of "
            f"{hosts[0]} they reach>'" + (f", e.g. one of {others}" if others else "")
        )
    # the cores each engine may use (labkit/cluster/share.py: its affinity, capped by a quota) shared
    # among its host's engines, at least one thread each
    threads = [max(1, usable_cores(i, default_cpus) // per_host[h]) for i, h in zip(infos, hosts)]
    ifnames = ["lo"] * len(infos) if loopback else [i.get("route_ifname") or "" for i in infos]
    return WorldSetup(backend, devices, addr, loopback, threads, ifnames if any(ifnames) else None, env, why)


def host_order(infos: list[dict]) -> list[int]:
    """The engines' indices in rank order: host by host (hosts in order of first appearance), and
    within a host by the launcher's own rank (mpiexec's, srun's) where it gave one, else as listed."""
    first: dict[str, int] = {}
    for k, i in enumerate(infos):
        first.setdefault(i["host"], k)
    return sorted(
        range(len(infos)),
        key=lambda k: (
            first[infos[k]["host"]],
            # engines with a launcher rank first, in its order (mpiexec and srun number a host's tasks)
            infos[k].get("launcher_rank") is None,
            infos[k].get("launcher_rank") or 0,
            k,
        ),
    )


def watchable(info: dict, mine: dict) -> bool:
    """Whether the process of an engine reporting `info` can be watched by its pid from here: the
    same machine (boot id) and the same pid namespace as `mine` (this process's engine_info)."""
    return (
        bool(info.get("boot_id"))
        and info.get("boot_id") == mine.get("boot_id")
        and info.get("pid_ns") == mine.get("pid_ns")
    )


def forwarded_env(environ) -> dict[str, str]:
    """The variables of `environ` that the engines should see as well (FORWARDED_*)."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES}


def backend_problems(cfg: ParallelConfig, backend: str, devices: list[str]) -> list[str]:
    """What a layout cannot do on this world's backend and devices, each with a fix (a
    ConfigError before any engine work)."""
    shared_gpus = backend == "gloo" and any(d.startswith("cuda") for d in devices)  # gloo on CUDA tensors
    if shared_gpus and cfg.torch_impl and cfg.pp > 1:
        return [
            "impl='torch' with pp > 1 on ranks sharing GPUs (gloo on CUDA tensors): torch.distributed.pipelining "
            "sends CUDA tensors through gloo, which has no send/recv for them ('writev ... Bad address'). "
            "Use impl='lab' (its point-to-point goes through host memory), one GPU per engine (NCCL), or device='cpu'"
        ]
    return []
