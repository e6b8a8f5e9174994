"""A training run on one rank: the function Lab.run executes on every engine.

It builds the mesh, the full model from the seed, this rank's share of it (parallelize), and
runs `steps` steps on the same global batches the reference sees (then, on text, this rank's
share of the validation loss). It returns plain data: the rank's losses, memory, collective log
and timeline — never tensors.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from labkit.config import DIMS, RunSpec
from labkit.engines import data, evaluate, runtime
from labkit.engines.locate import Recorder
from labkit.engines.mesh import Mesh
from labkit.engines.meters.audit import CommAudit
from labkit.engines.meters.bundle import Meters
from labkit.engines.meters.float8 import Float8Count
from labkit.engines.model import build_model
from labkit.engines.moe import MoE, update_expert_bias
from labkit.engines.parallel.common import piece
from labkit.engines.parallelize import parallelize
from labkit.engines.routes import RouteLog
from labkit.layout.mesh import MeshLayout


def data_index(mesh: Mesh) -> tuple[int, int]:
    """(index, count) of this rank's slice of the global batch: the batch is split over dp x ep."""
    c = mesh.coords
    return c["dp"] * mesh.size("ep") + c["ep"], mesh.size("dp", "ep")


def run_rank(spec: dict) -> dict:
    """spec: a RunSpec as plain data (RunSpec.to_dict(), what Lab.run sends). Returns this rank's
    report as plain data."""
    rt = runtime.current()
    run = RunSpec.from_dict(spec)
    if not run.comm_log:  # the overhead benchmark's switch: no collective log at all
        runtime.comm_log_off()
    cfg, model_cfg, steps, seed = run.parallel, run.model, run.steps, run.seed

    mesh = Mesh.build(MeshLayout.of(cfg), rt.rank)
    # the intra-op threads: bf16 kernels split their work by them, and the oracle computes as the ranks do
    base = {"rank": rt.rank, "host": rt.host, "device": rt.device, "clock_offset": rt.clock_offset}
    base["threads"] = torch.get_num_threads()
    if not mesh.active:
        return {**base, "idle": True}

    device = torch.device(rt.device)
    meters = Meters(mesh, device, run.comm_log)
    # the vocabulary padded for this tp (ModelConfig.vocab_divisible_by), then sliced
    full = build_model(model_cfg, seed, cfg.tp)
    buffers = {id(b): n for n, b in full.named_buffers()}  # the MoE routers' biases, by their full names
    rank_model = parallelize(full, mesh, cfg, run.optim, meters)
    modules = [m for chunk in rank_model.chunks for m in chunk.modules()]
    # the global batch's tokens are split over dp x ep x cp: the loads are summed over them
    tokens_group = mesh.group("dp", "ep", "cp") if mesh.size("dp", "ep", "cp") > 1 else None
    meters.memory.exclude(p for chunk in rank_model.chunks for p in chunk.parameters())
    audit = CommAudit() if run.audit else None
    float8 = Float8Count() if cfg.numerics.fp8 else None  # what ran in fp8: the oracle holds it to the layout
    moes = [m for m in modules if isinstance(m, MoE)]
    # the oracle replays a checked run's routing (labkit/oracle/replay.py): recorded only where it is checked
    routes = RouteLog(meters.timeline) if run.return_grads and moes else None
    for moe in moes:
        moe.route_log = routes

    # the first step's every module, recorded on this rank (engines/locate.py): locate=True alone
    recorder = Recorder(rank_model.chunks) if run.locate else None
    index, count = data_index(mesh)
    shapes_only = rt.backend == "fake"  # a dry run (engines/dryrun.py): its tensors hold no values
    losses, norms, step_times, grad_pieces = [], [], [], []  # grad_pieces: per step
    with meters, audit or nullcontext(), float8 or nullcontext():
        for step in range(steps):
            runtime.stop_agreed(mesh.agree)  # every rank stops here together, or none does
            if float8 is not None:
                float8.begin_step()
            tokens, targets = data.batch(run.data, step, seed, cfg.global_batch, model_cfg, shapes_only)
            tokens = data.shard(tokens, index, count).to(device)
            targets = data.shard(targets, index, count).to(device)
            t0 = time.perf_counter()
            if routes is not None:
                routes.begin_step()
            with meters.step(step, sum(rank_model.grads.memory().values())):
                loss = rank_model.schedule(rank_model, data.microbatches(tokens, targets, cfg.microbatches), meters)
                with meters.phase("backward"), meters.span("sync"):
                    rank_model.grads.finish()
                meters.wait_device()  # the gradients' collectives: step() reads their norm
                if run.return_grads or ((run.return_params or run.locate) and step == 0):  # the replay: every step's
                    grad_pieces.append(rank_model.grads.grad_pieces())
                if recorder is not None and step == 0:  # before the update: what locate compares is this step's
                    located = recorder.finish()
                with meters.phase("optimizer"), meters.span("opt"):
                    norm = rank_model.grads.step()
                    update_expert_bias(modules, tokens_group)  # DeepSeek-V3's aux-loss-free bias, if any
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            norms.append(norm)
            runtime.progress(
                step=step,
                steps=steps,
                rank=rt.rank,
                seconds=step_times[-1],
                ranks=mesh.size(*DIMS),
                loss_share=loss if mesh.coord("tp") == 0 else 0.0,
                shards=mesh.size("dp", "ep", "cp"),
            )

    states = rank_model.grads.memory()
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
        "info": rank_model.info,
    }
    if run.trains_on_text:  # after the steps, outside the meters: in no step's bytes or timeline
        report["validation"] = evaluate.validation_share(rank_model, mesh, cfg, model_cfg, index, count, device)
    if audit is not None:
        report["audit"] = dict(audit.counts)
    if float8 is not None:
        report["float8_matmuls"] = float8.steps
    if recorder is not None:
        report["activations"] = located
        report["grad_pieces"] = grad_pieces  # the first step's reduction, located as a phase
    if run.return_params:
        report["pieces"] = rank_model.grads.param_pieces()
        report["grad_pieces"] = grad_pieces
        if routes is not None:
            report["routes"] = routes.report()
        report["compute_pieces"] = rank_model.grads.compute_pieces()
        report["buffer_pieces"] = [piece(buffers[id(b)], b.shape, b) for m in modules for b in m.buffers(False)]
    return report
