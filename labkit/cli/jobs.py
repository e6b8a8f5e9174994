"""`labkit estimate/plan --from FILE`: your job's file read (labkit/config/jobs), what it leaves open
given on the command line, and the stack it runs on (the job's, or --stack) for its layout and the
planner's alternatives alike."""

from __future__ import annotations

import argparse

from labkit import theory
from labkit.config import ConfigError
from labkit.config.jobs import read_job
from labkit.theory.planner.stacks import STACKS


def job_of(ns: argparse.Namespace):
    """The job of --from FILE, printed (its stack among its lines); the layout flags override it later."""
    given = {k: getattr(ns, k) for k in ("seq", "micro_batch", "grad_accum", "config", "vocab") if getattr(ns, k, None)}
    if ns.from_file.lower().endswith(".json") and ns.precision:  # DeepSpeed's "auto" precision; else an override
        given["precision"] = ns.precision
    if ns.script_arg is not None:
        given["script_args"] = ns.script_arg
    if ns.env:
        given["env"] = dict(_pair(text) for text in ns.env)
    job = read_job(ns.from_file, hf=ns.hf, gpus=ns.gpus, **given)
    print(job.describe())
    if ns.stack and ns.stack != job.stack:
        print(f"  stack given: {ns.stack} (--stack), in place of the job's {job.stack}")
    return job


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise ConfigError([f"--env {text!r}: write NAME=VALUE, e.g. --env SLURM_NNODES=4"])
    return name, value


def stack_of(ns: argparse.Namespace, job) -> str:
    """--stack if given, else the job's (its reason printed with the job), else the planner's eager."""
    return ns.stack or (job.stack if job is not None else "eager")


def rank_job(job, model, hw, plans, stack: str) -> None:
    """The job's own layout, predicted on the same hardware and stack, and where it falls among the plans."""
    cfg = job.parallel
    if cfg.pp > 1:
        # the planner keeps an FSDP stage gathered under a pipeline whatever the flag says (planner/overlap.py),
        # and its arithmetic check (evaluate.layout_problems) refuses the flag's False once it reads FSDP as ZeRO-1
        cfg = cfg.replace(reshard_after_forward=True)
    own = theory.evaluate(cfg, model, hw, stack=stack)
    place = sum(p.tokens_per_second_per_gpu > own.tokens_per_second_per_gpu for p in plans) + 1
    where = f"#{place} of these {len(plans)}" if place <= len(plans) else f"below these {len(plans)}"
    print(f"\nyour job's layout ({stack} stack, as the alternatives): {own}\n  ranks {where} by predicted tokens/s/GPU")


def from_flags(p: argparse.ArgumentParser) -> None:
    """--from FILE and what a job file can leave open."""
    p.add_argument(
        "--from",
        dest="from_file",
        default=None,
        metavar="FILE",
        help="a job: torchtitan .toml, Megatron launch script or arguments, DeepSpeed .json (with --hf)",
    )
    p.add_argument("--hf", default=None, metavar="CONFIG_JSON", help="the model's config.json beside a DeepSpeed JSON")
    p.add_argument("--seq", type=int, default=None, help="the training sequence where the file leaves it open")
    p.add_argument("--config", default=None, metavar="NAME", help="which config of a torchtitan Python file")
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=None, help="a DeepSpeed 'auto' micro batch")
    p.add_argument("--grad-accum", dest="grad_accum", type=int, default=None, help="a DeepSpeed 'auto' accumulation")
    p.add_argument("--vocab", type=int, default=None, help="a Megatron job's vocabulary (labkit reads no tokenizer)")
    p.add_argument(
        "--script-arg",
        dest="script_arg",
        action="append",
        metavar="VALUE",
        help="a Megatron script's positional argument ($1, $2, ... in order); repeat for more",
    )
    p.add_argument(
        "--env", action="append", metavar="NAME=VALUE", help="a variable of the script's environment; repeat for more"
    )
    p.add_argument(
        "--stack",
        default=None,
        choices=list(STACKS),
        help="the software stack to price (default: the job's, which it names with its reason; eager without one)",
    )
