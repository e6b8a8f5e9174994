"""Megatron-LM's arguments -> labkit (labkit/config/jobs/__init__.py).

Follows Megatron-LM core_v0.14.0 (commit 23e00ed0), megatron/training/arguments.py: the names,
defaults and derived values of the arguments below (validate_args: --ffn-hidden-size defaults to
4h, or int(8h/3 / 64) * 64 with --swiglu; --global-batch-size to micro * DP; --moe-ffn-hidden-size
to --ffn-hidden-size; --make-vocab-size-divisible-by 128), and its launch: torchrun's --nnodes x
--nproc-per-node ranks before the script, its arguments after. The input is an argument list or a
launch script's text, evaluated as bash would evaluate it without running any of it (shell/: its
variables, arrays, arithmetic and tests; the caller's positional arguments and environment); the
model's arguments are read in megatron/model.py (MLA, shared experts, --moe-layer-freq patterns).

Megatron counts its ranks as world = TP * PP * CP * DP, expert parallelism inside DP (EP | DP),
in the order tp-cp-ep-dp-pp: labkit lays that out as dp = DP / EP and ep = EP in the same order.
Its expert-TP must be TP (labkit has one tp dim for dense and expert layers); what labkit cannot
express is refused by name, what it does not represent listed in Job.notes.
"""

from __future__ import annotations

from labkit.config import OptimConfig, ParallelConfig
from labkit.config.choices import ConfigError
from labkit.config.float8 import FP8_RECIPES
from labkit.config.jobs.job import Job, need_world, world_problem
from labkit.config.jobs.megatron.args import Args, parse, stages_of
from labkit.config.jobs.megatron.model import model_of
from labkit.config.jobs.shell import launch

READER = "Megatron-LM arguments (core_v0.14.0, arguments.py @ 23e00ed0)"
SHARDING = {"no_shard": "none", "optim": "zero1", "optim_grads": "zero2", "optim_grads_params": "zero3"}


def read(
    path=None,
    *,
    args: list[str] | None = None,
    text: str | None = None,
    gpus: int | None = None,
    vocab: int | None = None,
    seq: int | None = None,
    script_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    """The Job of a launch script (`path` or its `text`) or an argument list (`args`). `gpus`: the
    world size where no torchrun flags give it; `vocab` where no --vocab-size does; `seq` in place
    of --seq-length (a note says so); `script_args`: the script's positional arguments ($1 ...) and
    `env` its environment (${SLURM_NNODES:-1}), as the user would run it; none given, a bare run."""
    notes: list[str] = []
    if args is None:
        text = path.read_text() if text is None else text
        found = launch(text, script_args, env, name=getattr(path, "name", "the script"))
        words = found.words
        if found.via:
            notes.append(
                f"the launch is the value of {found.via} (line {found.line}), a command the script hands to "
                "another (sbatch, srun, bash -c); read as bash -c would read it"
            )
        notes += [f"shell: {n}" for n in found.notes]
    else:
        if script_args is not None or env is not None:
            raise ConfigError(["script_args= and env= apply to a launch script, not to an argument list (args=)"])
        words = list(args)
    launcher, raw = parse(words)
    a = Args(raw)
    source = "<arguments>" if path is None else str(path)
    notes += [
        f"--{k} (torchrun): not represented"
        for k in launcher
        if k not in ("nnodes", "nproc_per_node", "nproc-per-node")
    ]
    # torchrun spells its flags both ways; without them the world is the caller's to give
    per_node = launcher.get("nproc_per_node") or launcher.get("nproc-per-node")
    world = None
    if per_node is not None:
        try:
            world = int(launcher.get("nnodes") or 1) * int(per_node)
        except ValueError:
            raise ConfigError(
                [
                    f"torchrun --nnodes {launcher.get('nnodes')} --nproc-per-node {per_node}: labkit needs "
                    "whole numbers (no elastic ranges)"
                ]
            ) from None
    # every problem of the file at once, each with its fix: a refusal that names one makes a user fix, rerun
    # and fail again
    problems = world_problem(gpus, world, "torchrun's --nnodes x --nproc-per-node")
    if world is None and gpus is None:
        problems.append(
            "the arguments (no torchrun --nnodes/--nproc-per-node) leave the GPU count open; give it (gpus=N, on "
            "the command line --gpus N)"
        )
    world = need_world(gpus, world, "the arguments") if not problems else world or gpus
    tp, pp = a.get("tensor-model-parallel-size", int, 1), a.get("pipeline-model-parallel-size", int, 1)
    cp, ep = a.get("context-parallel-size", int, 1), a.get("expert-model-parallel-size", int, 1)
    model, more = model_of(a, vocab, problems, tp)
    notes += more
    if model is not None and seq and seq != model.seq:
        notes.append(f"--seq-length {model.seq}: replaced by seq={seq} (given)")
        model = model.replace(seq=seq)
    etp = a.get("expert-tensor-parallel-size", int, tp)
    if etp != tp:
        problems.append(
            f"--expert-tensor-parallel-size {etp} differs from --tensor-model-parallel-size {tp}: Megatron's "
            "MoE parallel folding (expert parallelism folded over the tensor-parallel ranks) is not expressible "
            "on labkit's mesh, which has one tp dim for the dense and the expert layers (experts whole on each "
            f"tp rank, split over the ep dim); give --expert-tensor-parallel-size {tp}"
        )
    dp = None
    if world is not None and world % (tp * pp * cp):
        problems.append(
            f"world {world} GPUs is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = {tp * pp * cp}: give "
            f"{tp * pp * cp} GPUs or a multiple (torchrun's --nnodes x --nproc-per-node), or smaller degrees"
        )
    elif world is not None:
        dp = world // (tp * pp * cp)  # Megatron's data-parallel size, its expert ranks inside it
        if dp % ep:
            problems.append(
                f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} (world "
                f"{world} / (TP {tp} x PP {pp} x CP {cp})): Megatron's experts split the data-parallel ranks"
            )
    micro = a.get("micro-batch-size", int)
    if micro is None:
        problems.append("the arguments have no --micro-batch-size (Megatron requires it); give it")
    # the global batch defaults to one micro batch per data-parallel rank: no accumulation
    glob = a.get("global-batch-size", int, micro * dp if micro and dp else None)
    if micro and dp and glob % (micro * dp):
        problems.append(
            f"--global-batch-size {glob} is not divisible by --micro-batch-size {micro} x the "
            f"data-parallel size {dp} (world {world} / (TP {tp} x PP {pp} x CP {cp}))"
        )
    if problems:
        raise ConfigError(problems)
    vp, stage_layers = stages_of(a, model.layers, pp) if pp > 1 else (1, ())
    return Job(
        ParallelConfig(
            dp=dp // ep,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            sharding=_sharding(a),
            # validate_args turns sequence parallelism off at TP 1 (it would only change the numerics)
            sequence_parallel=a.flag("sequence-parallel") and tp > 1,
            # Megatron's rank order (initialize.py: initialize_model_parallel's order), labkit's spelling
            order="tp-cp-ep-pp-dp" if a.flag("use-tp-pp-dp-mapping") else "tp-cp-ep-dp-pp",
            schedule="interleaved" if vp > 1 else "1f1b",
            virtual_stages=vp,
            stage_layers=stage_layers,
            microbatches=glob // (micro * dp),
            global_batch=glob,
            precision=_precision(a, notes),
            fp8_recipe=_fp8_recipe(a, notes),
            checkpoint_activations=_recompute(a, notes),
        ),
        model,
        source,
        READER,
        _optim(a, notes),
        tuple(notes + a.rest()),
        gpus_per_node=int(per_node) if per_node is not None else None,
        **_stack(a),
    )


def _stack(a: Args) -> dict:
    """The stack a Megatron-Core job runs on: Transformer Engine's fused kernels unless told 'local'."""
    te = a.get("transformer-impl", str, "transformer_engine")  # core_v0.14.0's default
    if te == "local":
        return {"stack": "eager", "stack_reason": "--transformer-impl local: Megatron-Core's PyTorch modules, eager"}
    said = f"--transformer-impl {te}" if "transformer-impl" in a.args else f"{te}, core_v0.14.0's default"
    return {
        "stack": "te",
        "stack_reason": f"{said}: Transformer Engine's fused kernels, priced at the compile stack's measured "
        "pace until measured on a GPU",
    }


def _sharding(a: Args) -> str:
    # Megatron FSDP shards as --data-parallel-sharding-strategy says (default no_shard in core_v0.14.0);
    # without it the distributed optimizer shards the optimizer's state alone: ZeRO-1
    optimizer = a.flag("use-distributed-optimizer")  # Megatron FSDP requires it: read either way
    if a.flag("use-megatron-fsdp") or a.flag("use-custom-fsdp"):
        strategy = a.get("data-parallel-sharding-strategy", str, "no_shard")
        if strategy not in SHARDING:
            raise ConfigError([f"--data-parallel-sharding-strategy {strategy} is not one of {sorted(SHARDING)}"])
        return SHARDING[strategy]
    return "zero1" if optimizer else "none"


def _precision(a: Args, notes: list[str]) -> str:
    fp8, bf16, fp16 = a.get("fp8-format"), a.flag("bf16"), a.flag("fp16")
    if fp16:  # the same 2 bytes a value: memory and wire bytes are bf16's; the loss scaler is not modelled
        notes.append("--fp16: labkit prices fp16 as bf16 (the same bytes), without loss scaling")
    if fp8 is not None:
        notes.append(f"--fp8-format {fp8}: labkit's fp8 is per-tensor e4m3 forward, e5m2 gradients (torchao's)")
        return "fp8"
    return "bf16" if bf16 or fp16 else "fp32"


def _fp8_recipe(a: Args, notes: list[str]) -> str:
    """--fp8-recipe (Megatron-Core's default 'delayed': Transformer Engine's amax history), refused by the
    engines by name where labkit has no such recipe; fp8 attention noted (labkit's attention is bf16)."""
    for flag in ("fp8-dot-product-attention", "fp8-multi-head-attention"):
        if a.flag(flag):
            notes.append(f"--{flag}: fp8 attention is not built; labkit prices and runs attention in bf16")
    if a.get("fp8-format") is None:
        return "tensorwise"
    recipe = a.get("fp8-recipe", str, "delayed")
    if recipe not in FP8_RECIPES:
        raise ConfigError([f"--fp8-recipe {recipe} is not one labkit knows; it knows {list(FP8_RECIPES)}"])
    return recipe


def _recompute(a: Args, notes: list[str]):
    if a.flag("recompute-activations"):  # the old spelling of --recompute-granularity selective
        return "selective"
    gran = a.get("recompute-granularity")
    method, n = a.get("recompute-method"), a.get("recompute-num-layers", int)
    modules = a.get("recompute-modules", list, ["core_attn"])
    if gran is None:
        return False
    if gran == "selective":
        if set(modules) != {"core_attn"}:
            notes.append(
                f"--recompute-modules {' '.join(modules)}: labkit's 'selective' recomputes the attention "
                "core only (Korthikanti et al.)"
            )
        return "selective"
    if gran != "full":
        raise ConfigError([f"--recompute-granularity {gran} is not 'full' or 'selective'"])
    # uniform with 1 layer per unit is every block recomputed from its input: labkit's 'full'
    if (method, n) not in ((None, None), ("uniform", 1)):
        notes.append(
            f"--recompute-method {method} --recompute-num-layers {n}: labkit's 'full' keeps every block's "
            "input and recomputes every block"
        )
    return "full"


def _optim(a: Args, notes: list[str]) -> OptimConfig:
    # Megatron's 'adam' is AdamW (decoupled weight decay), as labkit's
    if a.get("optimizer", str, "adam") != "adam":
        notes.append(f"--optimizer {a.args['optimizer']}: labkit's optimizer is AdamW (its state bytes priced)")
    return OptimConfig(
        lr=a.get("lr", float, 3e-3),
        beta1=a.get("adam-beta1", float, 0.9),
        beta2=a.get("adam-beta2", float, 0.999),
        eps=a.get("adam-eps", float, 1e-8),
        weight_decay=a.get("weight-decay", float, 0.01),
        clip=a.get("clip-grad", float, 1.0),
    )
