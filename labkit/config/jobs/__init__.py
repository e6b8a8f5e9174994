"""Your job, read into labkit's layout: a torchtitan TOML, a Megatron-LM launch (its arguments or
the script's text), or a DeepSpeed JSON beside a Hugging Face config.json, each made into the
ParallelConfig + ModelConfig (+ OptimConfig) it runs, with every field labkit cannot represent
listed by name in `Job.notes` (never dropped silently) and every contradiction a ConfigError that
quotes the fields from the user's file.

    read_job("llama3_8b.toml", gpus=64)                # torchtitan: dp_shard=-1 takes the GPUs left
    read_job("pretrain_405b.sh")                       # Megatron: the world from torchrun's flags
    read_job("train_mixtral.sh", vocab=32000, env={"SLURM_NNODES": "4"}, script_args=["/ckpt"])
    read_job("ds_zero3.json", hf="config.json", gpus=8, seq=4096, micro_batch=1)

Each reader names the version of the project it follows (the file and commit it read) at its
top: torchtitan/, megatron/, deepspeed.py. Plain Python (tomllib, json, ast, and shell/'s
evaluator of a launch script) at the config rung: no torch, nothing of the project it reads is
imported or run, no command of a script is run. Each Job names the software stack it runs on (eager,
compile, Megatron-Core's Transformer Engine) and why, which the planner prices it at.

Where the projects' layouts meet labkit's mesh: torchtitan's FSDP over data_parallel_shard_degree
is labkit's sharding='fsdp' over dp (impl='torch', PyTorch's FSDP2 and DTensor, as torchtitan
runs them); Megatron's data-parallel size holds its expert-parallel ranks (world = TP*PP*CP*DP,
EP | DP), which labkit lays out as dp = DP / EP data-parallel ranks of ep expert ranks each, in
Megatron's own order tp-cp-ep-dp-pp; DeepSpeed's ZeRO stage is labkit's of the same number.
"""

from __future__ import annotations

import pathlib

from labkit.config.choices import ConfigError
from labkit.config.jobs import deepspeed, megatron, torchtitan
from labkit.config.jobs.job import Job

__all__ = ["Job", "read_job"]


def read_job(path, *, hf=None, gpus: int | None = None, **given) -> Job:
    """The Job of a file, by its kind: .toml or .py (torchtitan), .json (DeepSpeed: `hf` names the model's
    config.json), anything else a Megatron launch script or arguments file. `gpus`: the GPU count
    where the file leaves it open (torchtitan's dp_shard=-1, a Megatron argument list without
    torchrun, DeepSpeed); must agree with the file where the file says. `given`: the reader's
    other keywords (DeepSpeed's values of "auto" fields, the training `seq`; a Megatron script's
    positional arguments `script_args` and its environment `env`, as the user would run it)."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(
            [
                f"job file {str(path)!r} does not exist; give a torchtitan .toml, a DeepSpeed .json "
                "(with --hf config.json) or a Megatron launch script"
            ]
        )
    suffix = p.suffix.lower()
    takes = {".toml": {"seq"}, ".py": {"seq", "config"}, ".json": {"seq", "micro_batch", "grad_accum", "precision"}}
    takes = takes.get(suffix, {"seq", "vocab", "script_args", "env"})
    if set(given) - takes:
        raise ConfigError([f"{sorted(set(given) - takes)} do not apply to {p.name}; its reader takes {sorted(takes)}"])
    if suffix in (".toml", ".py"):  # torchtitan's TOML, or its newer Python train config (read, never run)
        return torchtitan.read(p, gpus=gpus, **given)
    if suffix == ".json":
        if hf is None:
            raise ConfigError(
                [
                    f"{p.name} is a DeepSpeed JSON: it holds no model; give the model's Hugging Face "
                    "config.json too (hf=..., on the command line --hf PATH)"
                ]
            )
        return deepspeed.read(p, hf, gpus=gpus, **given)
    return megatron.read(p, gpus=gpus, **given)
