"""A training run on one rank: the function Lab.run executes on every engine.

It builds the mesh, the full model from the seed, this rank's share of it (parallelize), and
runs `steps` steps on the same global batches the reference sees. It returns plain data: the
rank's losses, memory, collective log and timeline — never tensors.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.engines import data, runtime
from labkit.config import DIMS
from labkit.engines.mesh import Mesh
from labkit.engines.meters.bundle import Meters
from labkit.engines.model import build_model
from labkit.engines.parallelize import parallelize
from labkit.plans.mesh import MeshLayout


def data_index(mesh: Mesh) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch: the batch is split over dp x ep."""
    c = mesh.coords
    return c["dp"] * mesh.size("ep") + c["ep"], mesh.size("dp", "ep")


def run_rank(spec: dict) -> dict:
    """spec: {'parallel': dict, 'model': dict, 'optim': dict, 'steps', 'seed', 'return_params',
    'audit'} (plain data from the Lab). Returns this rank's report as plain data."""
    rt = runtime.current()
    comm_log = spec.get("comm_log", True)
    if not comm_log:            # the overhead benchmark's switch: no collective log at all
        runtime.comm_log_off()
    cfg = ParallelConfig.from_dict(spec["parallel"])
    model_cfg = ModelConfig.from_dict(spec["model"])
    optim = OptimConfig.from_dict(spec["optim"])
    steps, seed = spec["steps"], spec["seed"]

    mesh = Mesh.build(MeshLayout.of(cfg), rt.rank)
    base = {"rank": rt.rank, "host": rt.host, "device": rt.device, "clock_offset": rt.clock_offset}
    if not mesh.active:
        return {**base, "idle": True}

    device = torch.device(rt.device)
    meters = Meters(mesh, device, comm_log)
    par = parallelize(build_model(model_cfg, seed), mesh, cfg, optim, meters)
    meters.memory.exclude(p for chunk in par.chunks for p in chunk.parameters())
    audit = None
    if spec.get("audit"):
        from labkit.engines.meters.comm import CommAudit
        audit = CommAudit()

    index, count = data_index(mesh)
    losses, norms, step_times = [], [], []
    with meters, (audit or nullcontext()):
        for step in range(steps):
            runtime.check_cancelled()
            tokens, targets = data.global_batch(step, seed, cfg.global_batch, model_cfg.seq, model_cfg.vocab)
            tokens = data.shard(tokens, index, count).to(device)
            targets = data.shard(targets, index, count).to(device)
            t0 = time.perf_counter()
            with meters.step(step, sum(par.grads.memory().values())):
                loss = par.schedule(par, data.microbatches(tokens, targets, cfg.microbatches), meters)
                with meters.phase("backward"), meters.span("sync"):
                    par.grads.finish()
                with meters.phase("optimizer"), meters.span("opt"):
                    norm = par.grads.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            norms.append(norm)
            runtime.progress(step=step, steps=steps, rank=rt.rank, seconds=step_times[-1], ranks=mesh.size(*DIMS),
                             loss_share=loss if mesh.coord("tp") == 0 else 0.0, shards=mesh.size("dp", "ep", "cp"))

    states = par.grads.memory()
    report = {
        **base,
        "idle": False,
        "coords": mesh.coords,
        "losses": losses,
        "grad_norms": norms,
        "step_times": step_times,
        "memory": meters.memory_report(states),
        "comm": meters.comm_events(),
        "timeline": meters.timeline.events,
        "info": par.info,
    }
    if audit is not None:
        report["audit"] = dict(audit.counts)
    if spec.get("return_params"):
        report["pieces"] = par.grads.pieces()
    return report

