"""The command line: the same machinery as the notebook, no notebook.

    labkit run                                  # the default demo: 4 CPU engines, dp=4
    labkit run --engines 4 --dp 2 --tp 2 --steps 3 --report report.html
    labkit estimate --dp 64 --tp 8 --pp 4       # the theory table, no cluster
    labkit estimate --model llama-70b --dp 32 --tp 8 --pp 4 --microbatches 16 --global-batch 512
    labkit plan --model llama-3.1-70b --gpus 256 --hardware h100   # the best layouts, what fills a GPU
    labkit estimate --from llama3_70b.toml --gpus 64               # your job's file: torchtitan, Megatron, DeepSpeed
    labkit plan --from pretrain_405b.sh                            # the planner's layouts, your job's ranked among them
    sudo labkit who                             # every Lab on this machine: whose, engines, cores, GPUs
    labkit torchrun --engines 4 train.py --steps 3 --report report.html   # your script, as torchrun runs it
    labkit plan --from train_mixtral.sh --vocab 32000 --env SLURM_NNODES=4 --stack compile

This is the top rung of the import ladder: the only module that imports both the Lab and the
figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import typing

from labkit import reference, theory
from labkit.cli import script
from labkit.cli.jobs import from_flags, job_of, rank_job, stack_of
from labkit.cluster import census
from labkit.config import ConfigError, ModelConfig, ParallelConfig
from labkit.config.table import human_bytes
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import loss_errors, mismatches
from labkit.theory.planner.evaluate import describe
from labkit.theory.planner.gpu_memory import TERMS
from labkit.theory.planner.hardware import HARDWARE
from labkit.theory.planner.stacks import with_stack
from labkit.theory.presets import PRESETS, preset

DEMO = {"dp": 4}


def _ints(text: str) -> tuple[int, ...]:
    """'15,16,16' -> (15, 16, 16): a tuple field on the command line (stage_layers)."""
    return tuple(int(x) for x in text.split(","))


def _bool_or_str(text: str) -> bool | str:
    return {"true": True, "false": False}.get(text.lower(), text)


def _add_fields(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + (prefix + f.name).replace("_", "-")
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is tuple:
            kind = _ints
        elif typing.get_origin(kind) is typing.Literal:  # a choice: the config names its values if wrong
            kind = _bool_or_str if bool in {type(a) for a in args} else str
        elif len(args) == 1:  # X | None: None is the family's default (ModelConfig)
            kind = args[0]
        if kind is bool:
            parser.add_argument(flag, dest=prefix + f.name, action=argparse.BooleanOptionalAction, default=None)
        elif kind is _bool_or_str:  # checkpoint_activations: true, false, full, selective, op
            parser.add_argument(flag, dest=prefix + f.name, type=_bool_or_str, default=None, metavar=f.name.upper())
        elif dataclasses.is_dataclass(kind):
            continue  # a nested config (rope_scaling): from a preset or ModelConfig.from_hf, not a flag
        else:
            parser.add_argument(flag, dest=prefix + f.name, type=kind, default=None, metavar=f.name.upper())


def _pick(ns: argparse.Namespace, cls, prefix: str = "") -> dict:
    return {
        f.name: getattr(ns, prefix + f.name)
        for f in dataclasses.fields(cls)
        if getattr(ns, prefix + f.name, None) is not None
    }


def write_report(path: str, result, ref, estimate) -> None:
    """One self-contained HTML page with every figure (plotly.js inlined once)."""
    from labkit.widgets.figures import report_figures

    figs = report_figures(result, ref, estimate)
    parts = []
    for i, (name, fig) in enumerate(figs.items()):
        parts.append(f'<section id="{name}">' + fig.to_html(full_html=False, include_plotlyjs=(i == 0)) + "</section>")
    cfg = result.config
    head = (
        f"<h1>labkit run</h1><p>{cfg.world} ranks: dp={cfg.dp} tp={cfg.tp} pp={cfg.pp} cp={cfg.cp} "
        f"ep={cfg.ep}, sharding={cfg.sharding}, impl={cfg.impl}, precision={cfg.precision}, "
        f"{result.steps} steps; losses {', '.join(f'{x:.4f}' for x in result.losses)}</p>"
    )
    with open(path, "w") as f:
        f.write(
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>labkit report</title></head><body>"
            + head
            + "\n".join(parts)
            + "</body></html>"
        )


def cmd_run(ns: argparse.Namespace) -> int:
    from labkit.cluster.lab import (
        Lab,  # deferred: ipyparallel, so that `labkit estimate` starts fast
    )

    parallel = _pick(ns, ParallelConfig) or dict(DEMO)
    cfg = ParallelConfig(**parallel)
    model = ModelConfig(**_pick(ns, ModelConfig, "model_"))
    engines = ns.engines or max(4, cfg.world)
    with Lab(engines=engines, backend=ns.backend, timeout=ns.timeout, progress=True) as lab:  # text bars
        print(lab, flush=True)
        res = lab.run(cfg, model=model, steps=ns.steps, seed=ns.seed, return_params=True)
    ref = reference(model, steps=ns.steps, seed=ns.seed, global_batch=cfg.global_batch)  # fp32: the oracle
    est = theory.estimate(cfg, model, world=engines)
    errs = loss_errors(res.losses, ref.losses)
    print(f"losses    {[f'{x:.5f}' for x in res.losses]}")
    print(f"reference {[f'{x:.5f}' for x in ref.losses]}  (max relative error {max(errs):.2e})")
    for rk in res.ranks:
        mem = ", ".join(f"{k} {human_bytes(v)}" for k, v in rk.memory.items())
        print(f"rank {rk.rank} {rk.coords}: {mem}")
    for row in res.comm_table():
        print(
            f"rank {row['rank']} {row['dim']:>6} {row['op']:<15} {row['calls']:>3} calls "
            f"{human_bytes(row['wire_bytes'])} sent"
        )
    if ns.report:
        write_report(ns.report, res, ref, est)
        print(f"report written to {ns.report}")
    if ns.trace:
        res.save_trace(ns.trace)
        print(f"trace written to {ns.trace} (open in ui.perfetto.dev)")
    found = mismatches(res, ref)
    if found:
        lines = "\n".join(f"  {m}" for m in found)
        print(f"labkit: the run does not train like the one-process reference:\n{lines}", file=sys.stderr)
        return 1
    print("matches the one-process reference (labkit/oracle/checks.py)")
    return 0


def cmd_estimate(ns: argparse.Namespace) -> int:
    """The theory for a layout: memory of the fullest rank, its wire bytes per dim and op, the
    bubble, and the time model's step on the chosen hardware (which dim dominates)."""
    job = None
    if ns.from_file:
        job = job_of(ns)
        cfg, model = (
            job.parallel.replace(**_pick(ns, ParallelConfig)),
            job.model.replace(**_pick(ns, ModelConfig, "model_")),
        )
        ns.model = pathlib.Path(ns.from_file).name
    else:
        cfg = ParallelConfig(**_pick(ns, ParallelConfig))
        model = _preset(ns.model).replace(**_pick(ns, ModelConfig, "model_"))
    est = theory.estimate(cfg, model, world=ns.world)
    hw = HARDWARE[ns.gpu]
    if job is not None or ns.stack:  # the job's stack (or the one given); a bare layout at the roofline, as before
        hw = with_stack(hw, stack_of(ns, job))
    print(
        f"{ns.model or 'model'}: Ψ = {theory.num_params(model):,} parameters; {est.world:,} ranks "
        f"({MeshLayout.of(cfg).describe()}, {cfg.order})"
    )
    fullest = max(range(len(est.memory)), key=lambda r: est.memory[r]["peak"])
    m = est.memory[fullest]
    print(
        f"memory per rank (rank {fullest}, the fullest): "
        + ", ".join(f"{k} {human_bytes(v)}" for k, v in m.items())
        + f"  [{hw.name}: {human_bytes(hw.memory)}]"
    )
    rows = est.rank_rows(fullest)
    for row in sorted(rows, key=lambda r: (r["dim"], r["op"])):
        print(
            f"comm per step (rank {fullest}) {row['dim']:>8} {row['op']:<15} {row['calls']:>7,} calls "
            f"{human_bytes(row['wire_bytes'])}"
        )
    print(f"bubble {est.bubble:.3f}")
    t = est.step_time(hw, fullest)
    print(
        f"step time on {hw.name}: {t.total * 1e3:,.1f} ms (compute {t.compute * 1e3:,.1f} ms; "
        + ", ".join(f"{d} {x * 1e3:,.1f} ms exposed" for d, x in sorted(t.exposed.items()))
        + f"); dominated by {t.dominant}; MFU {t.mfu:.0%}"
    )
    return 0


def _preset(name: str | None) -> ModelConfig:
    if name is None:
        return ModelConfig()
    model = preset(name)
    if model is None:
        raise ConfigError([f"--model {name!r} is not a preset: choose one of {', '.join(PRESETS)}"])
    return model


def _held(text: str) -> tuple[str, object]:
    """'tp=8' -> ('tp', 8); 'sharding=fsdp' -> ('sharding', 'fsdp'); true/false are booleans."""
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise ConfigError([f"--fix {text!r}: write FIELD=VALUE, e.g. --fix tp=8 --fix sharding=fsdp"])
    if value.removeprefix("-").isdigit():  # a negative degree reaches the field check as the number it is
        return key, int(value)
    return key, {"true": True, "false": False}.get(value.lower(), value)


def cmd_plan(ns: argparse.Namespace) -> int:
    """The planner's best layouts for a model on a number of GPUs, one line each, then the first
    one's memory term by term and its time, and what was rejected and why."""
    job = None
    if ns.from_file:  # the job's model, GPU count, batch and precision; its own layout ranked below
        job = job_of(ns)
        model, ns.model = job.model.replace(**_pick(ns, ModelConfig, "model_")), pathlib.Path(ns.from_file).name
        ns.gpus, ns.global_batch = job.world, ns.global_batch or job.parallel.global_batch
        ns.precision = ns.precision or (job.parallel.precision if job.parallel.numerics.mixed else None)
    elif ns.gpus is None:
        raise ConfigError(["labkit plan needs --gpus N (or --from FILE, a job that says)"])
    else:
        model = _preset(ns.model).replace(**_pick(ns, ModelConfig, "model_"))
    hw = HARDWARE[ns.hardware]
    fixed = dict(_held(text) for text in ns.fix or ())
    stack = stack_of(ns, job)  # one stack for the job's own layout and every alternative
    plans = theory.plan(
        model, ns.gpus, hardware=hw, global_batch=ns.global_batch, top=ns.top, precision=ns.precision, fixed=fixed,
        stack=stack,
    )  # fmt: skip
    print(
        f"{ns.model or 'model'}: Ψ = {theory.num_params(model):,} parameters on {ns.gpus:,} x {hw.name}; "
        f"{plans.considered:,} layouts priced, {plans.timed:,} timed"
    )
    # the constants with neither a measurement nor a datasheet behind them, named (hardware.py)
    print("assumed (no measurement or datasheet): " + "; ".join(plans.assumptions))
    if not plans:
        print(f"nothing to rank: {plans.why}")
    else:
        print(f"{'#':>2} {'tokens/s/GPU':>13} {'MFU':>6} {'GiB':>6} {'bound':>8}  layout")
    for i, p in enumerate(plans, 1):
        gib = p.peak_bytes / 2**30
        mark = "*" if p.tight else " "
        print(f"{i:>2} {p.tokens_per_second_per_gpu:>13,.0f} {p.mfu:>6.1%} {gib:>6.1f}{mark}{p.bound:>8}  {p.layout()}")
    if any(p.tight for p in plans):
        print("   * over the device with the allocator's usual reserve: fits once it gives back its cache")
    if plans:  # what crosses the slow link: each candidate's busiest rank, per dim (theory/planner/links.py)
        print("\nGB per step of each one's busiest rank, per dim: over NVLink / across nodes")
    for i, p in enumerate(plans, 1):
        dims = [r for r in p.links() if r["dim"] != "total"]
        print(
            f"  #{i} "
            + " · ".join(f"{r['dim']} {r['GB over NVLink']:,.1f} / {r['GB across nodes']:,.1f}" for r in dims)
        )
    if plans:
        best = plans[0]
        mem = best.memory
        print(f"\nmemory of #1 (pipeline rank {mem['pp_rank']}, the fullest), GiB:")
        # cuBLAS's workspaces are a term only where the device measured them (gpu_memory.py)
        print("  " + ", ".join(f"{k} {mem[k] / 2**30:,.2f}" for k in (*TERMS, "workspaces") if k in mem))
        print(
            f"  allocated {mem['allocated'] / 2**30:,.2f}, reserved {mem['reserved'] / 2**30:,.2f}, "
            f"peak {mem['peak'] / 2**30:,.2f}, required {mem['required'] / 2**30:,.2f} of {hw.memory / 2**30:,.1f}"
        )
        print("time of #1, s: " + ", ".join(f"{k} {v:,.3f}" for k, v in best.breakdown["time"].items()))
    if job is not None:
        rank_job(job, model, hw, plans, stack)
    if plans.counts:
        print("\nrejected:")
        for reason, n in sorted(plans.counts.items(), key=lambda x: -x[1]):
            print(f"  {n:>7,}  {reason}")
        for r in plans.rejected[:3]:
            print(f"  e.g. {describe(r.config)}: {r.reason}")
    return 0


def cmd_who(ns: argparse.Namespace) -> int:
    """Every Lab on this machine: whose, its engines, cores, GPUs, memory (labkit/cluster/census.py)."""
    print(census.table(census.labs()))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="train a layout on a local cluster and report what it measured")
    run.add_argument("--engines", type=int, default=None, help="engines to start (default: max(4, layout))")
    run.add_argument("--steps", type=int, default=3)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    run.add_argument("--timeout", type=float, default=300.0)
    run.add_argument("--report", default=None, help="write a self-contained HTML report here")
    run.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    _add_fields(run, ParallelConfig)
    _add_fields(run, ModelConfig, "model_")
    run.set_defaults(fn=cmd_run)
    est = sub.add_parser("estimate", help="print the theory's prediction for a layout (no cluster)")
    est.add_argument("--world", type=int, default=None)
    est.add_argument(
        "--model",
        default=None,
        help="a preset (labkit/theory/presets.py): " + ", ".join(PRESETS) + "; --model-* flags override its fields",
    )
    est.add_argument("--gpu", default="h100", choices=list(HARDWARE), help="hardware of the time model")
    est.add_argument("--gpus", type=int, default=None, help="with --from: the GPU count where the file leaves it open")
    from_flags(est)
    _add_fields(est, ParallelConfig)
    _add_fields(est, ModelConfig, "model_")
    est.set_defaults(fn=cmd_estimate)
    pl = sub.add_parser("plan", help="the best layouts of a model on a number of GPUs (the planner, no cluster)")
    pl.add_argument("--model", default=None, help=f"a preset: {', '.join(PRESETS)}; --model-* flags override it")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs (with --from: where the file leaves it open)")
    from_flags(pl)
    pl.add_argument("--hardware", default="h100", choices=list(HARDWARE))
    pl.add_argument("--global-batch", dest="global_batch", type=int, default=None, help="sequences per step")
    pl.add_argument("--precision", default=None, choices=["bf16", "fp8"], help="default: both where the GPU has fp8")
    pl.add_argument("--top", type=int, default=10)
    pl.add_argument(
        "--fix",
        action="append",
        metavar="FIELD=VALUE",
        help="hold a layout field (dp, tp, pp, cp, ep, sharding, schedule, virtual_stages, microbatches, "
        "checkpoint_activations, sequence_parallel); repeat for more",
    )
    _add_fields(pl, ModelConfig, "model_")
    pl.set_defaults(fn=cmd_plan)
    who = sub.add_parser("who", help="every Lab on this machine: user, engines, cores, GPUs, memory (as root: all)")
    who.set_defaults(fn=cmd_who)
    script.add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.command is None:
        parser().print_help()
        return 0
    try:
        return ns.fn(ns)
    except ConfigError as e:
        print(f"labkit: {e}", file=sys.stderr)
        return 2
