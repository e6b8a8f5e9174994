"""A classroom's GPU server: which GPUs a Lab's engines get, when many notebooks share one machine.

    Lab(engines=4, gpus=None)        every GPU the machine has (CUDA's default)
    Lab(engines=4, gpus=[2, 3])      GPUs 2 and 3 only; two ranks on each (NCCL >= 2.30, else gloo)
    Lab(engines=4, gpus="auto")      four GPUs: those with the most free memory, then the fewest
                                     processes, so a new Lab goes where the others are not

Where the kernel already sees some GPUs only (CUDA_VISIBLE_DEVICES, a classroom spawner's share for
its student), every choice is among those: a list's indices count among them, 'auto' picks among
them (labkit/cluster/share.py states the rule).
    Lab(engines=4, gpus="auto", ranks_per_gpu=2, gpu_memory_fraction=0.2)
                                     two GPUs, two ranks on each, each rank's allocator capped
                                     at 20% of its GPU (torch.cuda.set_per_process_memory_fraction)

The engines see the chosen GPUs only (CUDA_VISIBLE_DEVICES, by UUID), and each takes its device
by its local rank on its host (labkit/cluster/world.py): one GPU each is NCCL, more ranks than GPUs is
NCCL where it runs two ranks on one GPU (>= 2.30), else gloo on CUDA tensors. The table comes from
NVML (nvidia-ml-py) or nvidia-smi; `pick` is a pure function of it, tested with made-up tables.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass

from labkit.cluster.errors import LabError

try:
    import pynvml  # nvidia-ml-py, optional: NVML's table without running nvidia-smi
except ImportError:
    pynvml = None

MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    index: int
    """nvidia-smi's index (PCI bus order)."""
    uuid: str
    total: int
    """Memory, bytes."""
    used: int
    """Memory in use, bytes (by every process, every user)."""
    processes: int
    """Compute processes on it now."""

    @property
    def free(self) -> int:
        return self.total - self.used


def pick(table: list[Gpu], count: int) -> list[Gpu]:
    """The `count` GPUs a new Lab should take: most free memory first, then fewest processes,
    then the lower index. Raises LabError when the machine has fewer."""
    if count > len(table):
        raise LabError(
            f"{count} GPUs wanted, the machine has {len(table)}; ask for fewer engines or more ranks_per_gpu"
        )
    # free memory decides first: a GPU another Lab already fills is the one to avoid; then the fewest
    # processes (contention for its compute); the index makes the choice the same on every call
    return sorted(table, key=lambda g: (-g.free, g.processes, g.index))[:count]


def visible_devices(
    gpus, engines: int, ranks_per_gpu: int | None, table: list[Gpu] | None = None, environ=None
) -> str | None:
    """What the engines' CUDA_VISIBLE_DEVICES should say (None: leave the kernel's, or CUDA's default).

    environ: the kernel's environment (default os.environ), whose CUDA_VISIBLE_DEVICES a classroom's
    spawner sets per student. The engines choose among those GPUs only (labkit/cluster/share.py): a
    list's indices count among them, 'auto' picks among them; '' (none) leaves nothing to choose."""
    seen = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    given = [x.strip() for x in seen.split(",") if x.strip()] if seen is not None else None
    if gpus is None:
        return None
    if gpus == "auto":
        table = read_table() if table is None else table
        # as many GPUs as the ranks fill at ranks_per_gpu each, the last one perhaps part-filled
        count = math.ceil(engines / (ranks_per_gpu or 1))
        if given is not None:
            table = [g for g in table if any(_names(x, g) for x in given)]
            if count > len(table):
                raise LabError(
                    f"{count} GPUs wanted, and this kernel may use {len(table)} (CUDA_VISIBLE_DEVICES={seen!r}); "
                    "ask for fewer engines or more ranks_per_gpu"
                )
        chosen = pick(table, count)
        # by UUID where there is one: nvidia-smi's index is PCI order, which CUDA's numbering need not follow
        return ",".join(g.uuid or str(g.index) for g in chosen)
    if given is None:
        return ",".join(str(g) for g in gpus)
    # indices count among the kernel's GPUs; a UUID must be one of them
    out = []
    for g in gpus:
        if isinstance(g, int) and 0 <= g < len(given):
            out.append(given[g])
        elif isinstance(g, str) and any(x.startswith(g) or g.startswith(x) for x in given):
            out.append(g)
        else:
            raise LabError(
                f"gpus={list(gpus)}: this kernel sees {len(given)} GPU(s) (CUDA_VISIBLE_DEVICES={seen}), and "
                f"{g!r} is not one of them; give indices 0..{len(given) - 1} among them, or gpus='auto'"
            )
    return ",".join(out)


def _names(entry: str, gpu: Gpu) -> bool:
    """Whether a CUDA_VISIBLE_DEVICES entry (an index, a UUID or its prefix) names `gpu`."""
    if entry.isdigit():
        return int(entry) == gpu.index
    return bool(gpu.uuid) and gpu.uuid.startswith(entry)


def gpu_problems(gpus, launcher: str, ranks_per_gpu, fraction) -> list[str]:
    """What is wrong with the GPU choice, each with a fix (ConfigError)."""
    bad = []
    if gpus is not None and gpus != "auto":
        if (
            not isinstance(gpus, (list, tuple))
            or not gpus
            or not all(isinstance(g, (int, str)) and not isinstance(g, bool) for g in gpus)
        ):
            bad.append(f"gpus={gpus!r}: give a list of GPU indices (or UUIDs), 'auto', or None")
        elif len(set(gpus)) != len(gpus):
            bad.append(f"gpus={gpus!r} names a GPU twice; list each once (ranks share GPUs by themselves)")
    if gpus is not None and launcher != "local":
        bad.append(
            f"gpus= chooses among this machine's GPUs, and launcher={launcher!r} may start engines elsewhere; "
            "ask the scheduler instead (slurm: gpus_per_task=1)"
        )
    if ranks_per_gpu is not None and (not isinstance(ranks_per_gpu, int) or ranks_per_gpu < 1):
        bad.append(f"ranks_per_gpu={ranks_per_gpu!r} must be a positive whole number")
    if ranks_per_gpu is not None and gpus != "auto":
        bad.append("ranks_per_gpu= goes with gpus='auto' (with a list, the engines share the listed GPUs)")
    if fraction is not None and not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        bad.append(f"gpu_memory_fraction={fraction!r} must be in (0, 1]: the share of its GPU a rank may allocate")
    return bad


def parse_smi(gpus_csv: str, apps_csv: str) -> list[Gpu]:
    """The table from `nvidia-smi --query-gpu=index,uuid,memory.total,memory.used` and
    `--query-compute-apps=gpu_uuid,pid` (both --format=csv,noheader,nounits; MiB)."""
    per_gpu: dict[str, int] = {}
    for line in apps_csv.strip().splitlines():
        uuid = line.split(",")[0].strip()
        if uuid:
            per_gpu[uuid] = per_gpu.get(uuid, 0) + 1
    out = []
    for line in gpus_csv.strip().splitlines():
        index, uuid, total, used = (f.strip() for f in line.split(",")[:4])
        # nounits: MiB, perhaps written as a float
        out.append(Gpu(int(index), uuid, int(float(total)) * MIB, int(float(used)) * MIB, per_gpu.get(uuid, 0)))
    return out


def read_table() -> list[Gpu]:
    """This machine's GPUs now: NVML if nvidia-ml-py is installed, else nvidia-smi, else none."""
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            out = []
            for k in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(k)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                procs = len(pynvml.nvmlDeviceGetComputeRunningProcesses(h))
                # older nvidia-ml-py returns the UUID as bytes
                out.append(Gpu(k, uuid if isinstance(uuid, str) else uuid.decode(), mem.total, mem.used, procs))
            return out
        # no driver NVML can talk to: nvidia-smi may still answer
        except pynvml.NVMLError:
            pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = [smi, "--format=csv,noheader,nounits"]
    gpus = subprocess.run(
        [*query, "--query-gpu=index,uuid,memory.total,memory.used"], capture_output=True, text=True, timeout=30
    )
    apps = subprocess.run([*query, "--query-compute-apps=gpu_uuid,pid"], capture_output=True, text=True, timeout=30)
    # no GPUs (or an error): an empty table, and `pick` says the machine has none
    return parse_smi(gpus.stdout, apps.stdout) if gpus.returncode == 0 else []
