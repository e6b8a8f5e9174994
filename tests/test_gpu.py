"""The GPU path (marked `gpu`, skipped without CUDA): NCCL at world 2 or more — two ranks on one
GPU where the machine has one (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE: labkit/cluster/world.py), one
GPU each where it has more —, the allocator's memory, CUDA-event timelines, and ranks sharing one
GPU through gloo. Run on a GPU server with `pytest -m gpu`; scripts/gpu-check.sh runs it with the
NCCL it needs on a lent one-GPU machine."""

from __future__ import annotations

import pytest
import torch

from labkit import Lab, ModelConfig, ParallelConfig, reference
from labkit.oracle.checks import assert_matches

pytestmark = pytest.mark.gpu

MODEL = ModelConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=256, seq=64)


@pytest.fixture(scope="module")
def gpu_lab():
    """An NCCL world of at least two ranks: one GPU each, or two sharing the only one."""
    n = max(2, torch.cuda.device_count())
    with Lab(engines=n, device="cuda", timeout=300, progress=False) as lab:
        if lab.backend != "nccl":
            pytest.skip(f"no NCCL world of {n} ranks on {torch.cuda.device_count()} GPU(s): {lab.backend_reason}")
        yield lab


def _nccl_env():
    import os

    return {k: v for k, v in os.environ.items() if k in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_MAX_CTAS")}


def test_the_gpu_lab_is_an_nccl_world_of_two_or_more(gpu_lab):
    assert gpu_lab.backend == "nccl" and gpu_lab.world >= 2
    assert all(d.startswith("cuda:") for d in gpu_lab.devices)
    env = gpu_lab.apply(_nccl_env, timeout=30)
    if torch.cuda.device_count() == 1:  # two ranks on the one GPU, with NCCL's flag on every engine
        assert gpu_lab.devices == ["cuda:0", "cuda:0"] and "NCCL_MULTI_RANK_GPU_ENABLE" in gpu_lab.backend_reason
        assert all(e.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" for e in env)
    else:  # one GPU each, no flag needed
        assert len(set(gpu_lab.devices)) == gpu_lab.world and gpu_lab.backend_reason == ""


def test_ddp_on_nccl_trains_like_one_process(gpu_lab):
    cfg = ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world)
    res = gpu_lab.run(cfg, model=MODEL, steps=3, return_params=True)
    # the reference runs on the CPU; GPU kernels sum in another order, well inside 1e-5 in fp32
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))
    # the gradients crossed between the ranks: one all-reduce row per rank over dp
    rows = [r for r in res.comm_table() if r["dim"] == "dp" and r["op"] == "all_reduce"]
    assert len(rows) == gpu_lab.world and all(r["payload_bytes"] > 0 for r in rows)


def test_cuda_memory_comes_from_the_allocator(gpu_lab):
    res = gpu_lab.run(ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world), model=MODEL, steps=2)
    for rk in res.ranks:
        m = rk.memory
        states = m["params"] + m["grads"] + m["optimizer"]
        # max_memory_allocated holds the states, the activations and the kernels' workspaces
        assert m["peak"] >= states + m["activations"]
        assert m["peak"] < 20 * (states + m["activations"])


def test_timeline_from_cuda_events_is_ordered(gpu_lab):
    res = gpu_lab.run(
        ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world, microbatches=2), model=MODEL, steps=2
    )
    for rk in res.ranks:
        spans = [e for e in rk.timeline if e.step == 1 and e.kind in ("F", "B")]
        assert [(e.kind, e.microbatch) for e in spans] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
        assert all(e.end > e.start for e in spans)
        assert all(a.end <= b.start + 1e-4 for a, b in zip(spans, spans[1:]))  # one stream: in order


def test_bf16_on_gpu(gpu_lab):
    """Against the fp32 reference (on the CPU), with the bounds derived from bf16's rounding
    (labkit/oracle/bounds.py): CUDA's bf16 kernels round like any others."""
    cfg = ParallelConfig(dp=gpu_lab.world, global_batch=8 * gpu_lab.world, precision="bf16", sharding="zero1")
    res = gpu_lab.run(cfg, model=MODEL, steps=3, return_params=True)
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))


def test_ranks_sharing_a_gpu_on_gloo_train_like_one_process():
    """backend='gloo' with more engines than GPUs: gloo on CUDA tensors (tensors stay on the GPU,
    gloo stages them through the host), what a shared GPU gets where NCCL is older than 2.30."""
    n = torch.cuda.device_count() + 1
    with Lab(engines=n, device="cuda", backend="gloo", progress=False, timeout=300) as lab:
        assert lab.backend == "gloo" and all(d.startswith("cuda:") for d in lab.devices)
        cfg = ParallelConfig(dp=n, global_batch=4 * n)
        res = lab.run(cfg, model=MODEL, steps=3, return_params=True)
    assert_matches(res, reference(MODEL, steps=3, global_batch=cfg.global_batch))


# -- a first hour on one GPU (review gpu-risks.md, last section) ---------------------------------
# Each probe is bounded (timeout=60 on the Lab's calls, pytest-timeout on the test) and asserts
# what would fail before the fixes. They need one GPU; more are fine.
M4 = MODEL.replace(layers=4)  # pp=2 x v=2: one layer per chunk


@pytest.fixture(scope="module")
def shared_lab():
    """Four ranks on the GPUs through gloo (device='cuda', backend='gloo'): with one GPU all on
    cuda:0, gloo carrying CUDA tensors — what a classroom on one GPU server runs where NCCL is
    older than 2.30. Four, for FSDP x PP; the other layouts use the first two."""
    with Lab(engines=4, device="cuda", backend="gloo", timeout=60, progress=False) as lab:
        assert lab.backend == "gloo" and all(d.startswith("cuda:") for d in lab.devices)
        yield lab


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(pp=2, microbatches=2, schedule="gpipe"),
        ParallelConfig(pp=2, microbatches=4, schedule="1f1b"),
        ParallelConfig(pp=2, virtual_stages=2, microbatches=4, schedule="interleaved"),
        ParallelConfig(pp=2, microbatches=2, schedule="zbh1"),
        ParallelConfig(pp=2, virtual_stages=2, microbatches=4, schedule="dualpipev"),
        ParallelConfig(pp=2, dp=2, microbatches=2, schedule="zbh1", sharding="fsdp"),
        ParallelConfig(cp=2),
        ParallelConfig(dp=2, sharding="zero3"),
        ParallelConfig(dp=2, sharding="zero1"),
        ParallelConfig(tp=2, impl="torch"),
        ParallelConfig(dp=2, sharding="fsdp", impl="torch"),
    ],
    ids=lambda c: f"pp{c.pp}v{c.virtual_stages}-cp{c.cp}-tp{c.tp}-dp{c.dp}-{c.sharding}-{c.impl}-{c.schedule}",
)
def test_gloo_on_cuda_trains_like_one_process(shared_lab, cfg):
    """Before: pp and cp died in gloo's send of a CUDA pointer (segfault, 'writev ... Bad
    address'), zero3 called an API torch < 2.13 lacks. Now the p2p is staged through host memory."""
    model = M4 if cfg.virtual_stages > 1 else MODEL
    res = shared_lab.run(cfg, model=model, steps=3, return_params=True, timeout=60)
    assert_matches(res, reference(model, steps=3, global_batch=cfg.global_batch))


def test_torch_pipelining_on_shared_gpus_is_refused_before_it_runs(shared_lab):
    from labkit import ConfigError

    jobs = shared_lab.jobs
    with pytest.raises(ConfigError, match="torch.distributed.pipelining sends CUDA tensors through gloo"):
        shared_lab.run(ParallelConfig(pp=2, microbatches=2, impl="torch"), model=MODEL, steps=1)
    assert shared_lab.jobs == jobs


def _current_devices():
    return torch.cuda.current_device(), torch.cuda.current_stream().device.index


@pytest.mark.timeout(300)
def test_every_rank_computes_on_its_own_device(gpu_lab):
    """The job thread binds the rank's device (CUDA's current device is per thread)."""
    want = [int(d.split(":")[1]) for d in gpu_lab.devices]
    assert gpu_lab.apply(_current_devices, timeout=60) == [(k, k) for k in want]


@pytest.fixture(scope="module")
def nccl_world_of_one():
    """One engine on a host with a GPU and device='auto': NCCL, what a notebook gets by default."""
    with Lab(engines=1, timeout=60, progress=False) as lab:
        assert lab.backend == "nccl"
        yield lab


def _enqueue_against_gpu() -> dict:
    """A ~1 s kernel, then an all-reduce: what the log and the flight recorder say while the GPU
    is still busy, and after it is done."""
    import time

    import torch.distributed as dist

    from labkit.engines import flight, runtime

    t = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles, queued: the host goes on
    t0 = time.perf_counter()
    dist.all_reduce(t)
    enqueue = time.perf_counter() - t0
    meter = runtime.job_comm_meter()
    meter.sweep()
    ev = dict(meter.events[-1])
    during = flight.gpu_ops()
    torch.cuda.synchronize()
    done = time.perf_counter() - t0
    meter.sweep()
    after = flight.gpu_ops()
    return {
        "enqueue": enqueue,
        "done": done,
        "ev": ev,
        "end": meter.events[-1]["end"],
        "during": during,
        "after": after,
    }


@pytest.mark.timeout(300)
def test_nccl_enqueues_and_the_flight_recorder_sees_the_gpu(gpu_lab):
    got = gpu_lab.apply(_enqueue_against_gpu, timeout=60)[0]
    assert got["enqueue"] < 0.2 * got["done"] and got["done"] > 0.3  # the host did not wait for the GPU
    assert got["ev"]["op"] == "all_reduce" and got["ev"]["end"] is None  # the log polls the GPU's progress
    assert got["end"] is not None and got["end"] - got["ev"]["start"] > 0.5 * got["done"]
    assert got["during"] is not None, "the flight recorder cannot be read in this build"
    assert [e["op"] for e in got["during"]["open"]][-1:] == ["all_reduce"]
    assert not any(e["op"] == "all_reduce" for e in got["after"]["open"])


def _batched_ring_p2p() -> bool:
    """One batch per rank: send 1M floats to the next rank, receive the previous rank's."""
    import torch.distributed as dist

    from labkit.engines.p2p import Link

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + rank
    buf = torch.empty_like(t)
    Link(dist.group.WORLD).batch([(t, (rank + 1) % world, 0)], [(buf, (rank - 1) % world, 0)]).wait()
    return bool(torch.equal(buf, t - rank + (rank - 1) % world))


@pytest.mark.timeout(300)
def test_batched_point_to_point_crosses_between_ranks_on_nccl(gpu_lab):
    assert gpu_lab.apply(_batched_ring_p2p, timeout=30) == [True] * gpu_lab.world


def _clock_with_two_hosts() -> float:
    """process_group.clock_offset as on two hosts (all_gather_object faked): its barrier and broadcast
    run on this NCCL world, which has no backend for CPU tensors."""
    import torch.distributed as dist

    from labkit.engines import process_group

    real = dist.all_gather_object
    dist.all_gather_object = lambda out, obj, group=None: out.__setitem__(slice(None), [obj, obj + "-other"])
    try:
        return process_group.clock_offset()
    finally:
        dist.all_gather_object = real


@pytest.mark.timeout(300)
def test_the_clock_handshake_runs_on_an_nccl_world(gpu_lab):
    """Before: 'No backend type associated with device type cpu' in Lab.connect across hosts."""
    assert all(abs(x) < 1.0 for x in gpu_lab.apply(_clock_with_two_hosts, timeout=30))


def _engine_gpus() -> dict:
    from labkit.engines.host import engine_info

    return engine_info()


@pytest.mark.timeout(300)
def test_engines_report_physical_gpus_and_sharing_one_is_seen(gpu_lab):
    from labkit.cluster.world import own_gpus, world_setup
    from labkit.engines.host import nccl_version

    info = gpu_lab.apply(_engine_gpus, timeout=30)[0]
    assert info["nccl"] == ".".join(map(str, nccl_version()))  # what this process runs too
    assert info["gpus"] >= 1 and len(set(info["gpu_uuids"])) == info["gpus"] and all(info["gpu_uuids"])
    one = dict(info, gpus=1, gpu_uuids=info["gpu_uuids"][:1])
    twin = dict(one, host=one["host"])  # a second engine bound to the same GPU
    assert own_gpus([one, twin]) is None and world_setup([one, twin]).devices == ["cpu", "cpu"]
    shared = world_setup([one, twin], device="cuda")
    assert shared.devices == ["cuda:0", "cuda:0"] and shared.backend == ("nccl" if gpu_lab.backend_reason else "gloo")
    other = dict(one, host=one["host"] + "-b", addr="10.9.9.9")  # faked second host, its own GPU
    assert world_setup([dict(one, addr="10.9.9.8"), other], local=False).backend == "nccl"


def _all_reduce_cpu_tensor():  # notebook 01's first cell body, on CPU tensors
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t)


@pytest.mark.timeout(300)
def test_device_auto_with_one_engine_is_nccl_and_a_cpu_notebook_asks_for_the_cpu(nccl_world_of_one):
    """On a GPU host 'auto' is NCCL, which refuses CPU tensors; device='cpu' (what the notebooks
    and the CPU fixtures say) gives gloo, where notebook 01's cells run."""
    from labkit import RankError

    with pytest.raises(RankError):
        nccl_world_of_one.apply(_all_reduce_cpu_tensor, timeout=30)
    with Lab(engines=1, device="cpu", timeout=60, progress=False) as cpu:
        assert cpu.backend == "gloo" and cpu.devices == ["cpu"]
        assert cpu.apply(_all_reduce_cpu_tensor, timeout=30) == [1.0]


def _reserved_after_collectives(log: bool) -> tuple[int, int]:
    """50 all-reduces of fresh 16 MiB buffers, each freed at once: the allocator's reserved and
    peak bytes, with the collective log on or off."""
    import torch.distributed as dist

    from labkit.engines import runtime

    if not log:
        runtime.comm_log_off()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(50):
        t = torch.ones(4 << 20, device="cuda")
        dist.all_reduce(t)
        del t
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()


@pytest.mark.timeout(300)
def _log_is_on() -> bool:
    from labkit.engines import runtime

    return runtime.job_comm_meter() is not None


@pytest.mark.timeout(300)
def test_the_collective_log_does_not_hold_freed_buffers(gpu_lab):
    """A CUDA future's callback records its outputs on a side stream (recordStream semantics):
    freed buffers then wait for it before they are reused, and reserved memory grows with the log
    on. The log polls CUDA works instead, so on and off reserve alike. The log is off for the one
    call that asks (runtime.comm_log_off ends with the job): the next call has it again."""
    on = gpu_lab.apply(_reserved_after_collectives, True, timeout=60)[0]
    off = gpu_lab.apply(_reserved_after_collectives, False, timeout=60)[0]
    assert gpu_lab.apply(_log_is_on, timeout=30) == [True] * gpu_lab.world
    mib = 1 << 20
    assert on[1] <= off[1] + 16 * mib, (on, off)
    assert on[0] <= off[0] + 64 * mib, (on, off)
