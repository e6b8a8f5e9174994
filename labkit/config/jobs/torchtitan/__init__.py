"""torchtitan's job TOML -> labkit (labkit/config/jobs/__init__.py).

Follows torchtitan's JobConfig as of commit 000204a4 (torchtitan/config/job_config.py: the
[training], [parallelism], [activation_checkpoint], [float8] fields and their defaults) and reads
the older spelling its published train_configs use (llama3_8b.toml / llama3_70b.toml at commit
f3534d77: [training] batch_size for local_batch_size) and the newer [compile] section (enable,
components; job_config.py at commit 08b8b244). The models are torchtitan 0.3.0's registry, every
family labkit builds and every flavor (torchtitan/flavors.py); Llama 3's equal labkit's presets of
Llama 3.1 (tests/test_jobs.py). Its newer Python train configs are read the same way, parsed and
never run (torchtitan/registry.py).

How torchtitan runs the layout, and so what labkit sets:
  data_parallel_shard_degree > 1    FSDP2 over those ranks: sharding='fsdp', impl='torch'
  data_parallel_replicate_degree    DDP across replicas (with shard > 1: HSDP, ParallelConfig.dp_replicate)
  tensor_parallel_degree > 1        DTensor TP with sequence parallelism on the norms (always, in its plan)
  pipeline_parallel_schedule        1F1B, GPipe, Interleaved1F1B, ZBVZeroBubble, DualPipeV; the looped
                                    ones two stages per rank unless layers_per_stage or split points say
  [activation_checkpoint] mode      none, full, selective with selective_ac_option 'op' (its per-op policy)
  [model] converters float8         fp8 matmuls (torchao), bf16 otherwise (mixed_precision_param)
  expert_parallel_degree            experts split over ep ranks inside data_parallel_shard (its MoE flavors)
  [training] compile, [compile]     torch.compile per block (ParallelConfig.compile), the stack 'compile'
"""

from __future__ import annotations

import re

try:  # the standard library's TOML parser from Python 3.11; labkit runs on 3.10 too
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - 3.10: the package tomllib was taken from, if installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

from labkit.config import OptimConfig, ParallelConfig
from labkit.config.choices import ConfigError
from labkit.config.jobs.fields import Fields
from labkit.config.jobs.job import Job, need_world, world_problem
from labkit.config.jobs.torchtitan import registry
from labkit.config.jobs.torchtitan.flavors import flavor_model

READER = "torchtitan TOML (job_config.py @ 000204a4)"
READER_PY = "torchtitan Python config, read with ast (train_configs/llama3_8b.py @ da236a8b; job_config.py @ 000204a4)"

SCHEDULES = {
    "1F1B": "1f1b",
    "GPipe": "gpipe",
    "Interleaved1F1B": "interleaved",
    "ZBVZeroBubble": "zbv",
    "DualPipeV": "dualpipev",
}
LOOPED = {"Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"}
"""Multi-stage schedules: torchtitan puts two stages on each rank unless told otherwise."""
NOT_LAID_OUT = "not part of the layout (labkit's estimate and runs do not use it)"


def _load(path) -> dict:
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError(["reading a TOML needs Python 3.11 (tomllib) or, on 3.10, `pip install tomli`"])
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{path.name} is not valid TOML ({e}); fix the line it names"]) from None


def _recompute(ac: Fields) -> tuple[object, list[str]]:
    mode = ac.take("mode", str, "none")
    option = ac.take("selective_ac_option", str, "2")
    if mode == "none":
        return False, []
    if mode == "full":
        return "full", []
    if mode != "selective":
        raise ConfigError([f"[activation_checkpoint] mode = {mode!r} is not one of 'none', 'selective', 'full'"])
    if option == "op":
        return "op", []
    # torchtitan's int option N checkpoints every Nth block whole; N = 1 is every block
    if option == "1":
        return "full", []
    if option.isdigit():
        return "full", [
            f"[activation_checkpoint] selective_ac_option = {option!r}: torchtitan recomputes every "
            f"{option}th block; labkit recomputes every block ('full'), so it prices more recompute "
            "and less activation memory than the job has"
        ]
    raise ConfigError([f"[activation_checkpoint] selective_ac_option = {option!r} is not 'op' or a whole number"])


def _stages(par: Fields, layers: int, pp: int, schedule: str) -> tuple[int, tuple[int, ...]]:
    """(virtual stages per rank, blocks of each stage or ()) from the split points or layers_per_stage."""
    # split points name the first block of each stage after the first ('layers.8'): cuts in the block list
    points = par.take("pipeline_parallel_split_points", list, [])
    per = par.take("pipeline_parallel_layers_per_stage", int)
    if points:
        cuts = []
        for p in points:
            m = re.fullmatch(r"layers\.(\d+)", str(p))
            if not m:
                raise ConfigError([f"[parallelism] pipeline_parallel_split_points entry {p!r} is not 'layers.N'"])
            cuts.append(int(m.group(1)))
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers]))
        if len(sizes) % pp or min(sizes) < 1:
            raise ConfigError(
                [
                    f"[parallelism] pipeline_parallel_split_points = {points} make {len(sizes)} stages, "
                    f"not a multiple of pipeline_parallel_degree = {pp} of non-empty stages"
                ]
            )
        return len(sizes) // pp, sizes
    if per is not None:
        if layers % (per * pp):
            raise ConfigError(
                [
                    f"[parallelism] pipeline_parallel_layers_per_stage = {per} does not split the "
                    f"model's {layers} layers over pipeline_parallel_degree = {pp} ranks evenly"
                ]
            )
        return layers // (per * pp), ()
    return (2 if schedule in LOOPED else 1), ()


def read(path, gpus: int | None = None, seq: int | None = None, config: str | None = None) -> Job:
    """The Job of a torchtitan TOML, or of a Python train config (`config`: which of the file's;
    torchtitan/registry.py); `gpus`: the GPU count when data_parallel_shard_degree = -1."""
    doc = registry.load(path, config) if path.suffix == ".py" else _load(path)
    notes: list[str] = []
    sec = {
        s: Fields(doc.get(s, {}), f"[{s}]")
        for s in ("model", "training", "parallelism", "activation_checkpoint", "float8", "optimizer", "compile")
    }
    mdl, tr, par = sec["model"], sec["training"], sec["parallelism"]
    seq_len = tr.take("seq_len", int, 2048)
    model, more = flavor_model(mdl.take("name", str, "llama3"), mdl.take("flavor", str, "debugmodel"), seq or seq_len)
    notes += more
    # a list in the current JobConfig; a comma-separated string in older configs
    converters = mdl.take("converters", (list, str), [])
    converters = [converters] if isinstance(converters, str) else converters
    # torchtitan's MX converter ("mx", its [mx] section) trains MXFP8: priced as fp8, refused by the engines
    fp8 = "float8" in converters or "mx" in converters
    compiled, stack_reason = _compiled(tr, sec["compile"])

    rep = par.take("data_parallel_replicate_degree", int, 1)
    shard = par.take("data_parallel_shard_degree", int, -1)
    tp, pp = par.take("tensor_parallel_degree", int, 1), par.take("pipeline_parallel_degree", int, 1)
    cp, ep = par.take("context_parallel_degree", int, 1), par.take("expert_parallel_degree", int, 1)
    if ep > 1 and not model.experts:
        raise ConfigError(
            [
                f"[parallelism] expert_parallel_degree = {ep} on {model.num_params():,}-parameter "
                f"flavor {mdl.data.get('flavor')!r}, which has no experts; set it to 1"
            ]
        )
    others = rep * tp * pp * cp
    if shard == -1:  # the ranks left over: the GPU count must come from outside the file
        world = need_world(gpus, None, "[parallelism] data_parallel_shard_degree = -1")
        if world % others:
            raise ConfigError(
                [
                    f"gpus={world} is not divisible by data_parallel_replicate_degree ({rep}) * "
                    f"tensor_parallel_degree ({tp}) * pipeline_parallel_degree ({pp}) * "
                    f"context_parallel_degree ({cp}) = {others}, so data_parallel_shard_degree = -1 "
                    "has no whole value"
                ]
            )
        shard = world // others
    else:
        found = world_problem(gpus, shard * others, "the product of [parallelism]'s degrees")
        if found:
            raise ConfigError(found)
    # HSDP (replicate > 1 and shard > 1): labkit's dp_replicate x dp_shard; else one of them is 1
    dp, hybrid = rep * shard, rep if rep > 1 and shard > 1 else 1
    if ep > 1:
        _experts(ep, rep, shard, notes)

    schedule_name = par.take("pipeline_parallel_schedule", str, "1F1B")
    if schedule_name not in SCHEDULES:
        raise ConfigError(
            [
                f"[parallelism] pipeline_parallel_schedule = {schedule_name!r} is not one labkit runs; "
                f"it runs {sorted(SCHEDULES)}"
            ]
        )
    virtual, stage_layers = _stages(par, model.layers, pp, schedule_name) if pp > 1 else (1, ())

    local = tr.take("local_batch_size", int) or tr.take("batch_size", int, 8)  # the published configs' spelling
    glob = tr.take("global_batch_size", int, -1)
    glob = local * dp if glob in (-1, None) else glob  # -1: no accumulation, torchtitan's default
    # a pipeline splits each local batch into microbatches; without one, a step accumulates whole local batches
    micro = par.take("pipeline_parallel_microbatch_size", int, 1) if pp > 1 else local
    if pp > 1 and local % micro:
        raise ConfigError(
            [
                f"[training] local_batch_size = {local} is not divisible by [parallelism] "
                f"pipeline_parallel_microbatch_size = {micro}"
            ]
        )
    if glob % (local * dp):  # dp here counts every data rank, the expert ranks among them
        raise ConfigError(
            [
                f"[training] global_batch_size = {glob} is not divisible by local_batch_size ({local}) * "
                f"the data-parallel degree ({dp}: replicate {rep} x shard {shard})"
            ]
        )

    reshard = par.take("fsdp_reshard_after_forward", str, "default")
    recompute, more = _recompute(sec["activation_checkpoint"])
    notes += more
    param_dtype = tr.take("mixed_precision_param", str, "bfloat16")
    # FSDP2's MixedPrecisionPolicy computes in mixed_precision_param with fp32 masters: labkit's bf16
    precision = "fp8" if fp8 else ("bf16" if param_dtype == "bfloat16" else "fp32")
    # [float8] recipe_name: None (tensorwise) in torchtitan's older JobConfig
    recipe = "mxfp8" if "mx" in converters else (sec["float8"].take("recipe_name", str) if fp8 else None)
    if cp > 1 and shard > 1:
        notes.append(
            f"[parallelism] context_parallel_degree = {cp}: torchtitan's FSDP shards over "
            "data_parallel_shard x context_parallel ranks; labkit's over dp alone"
        )
    cfg = ParallelConfig(
        dp=dp // ep,  # the data-parallel ranks hold the expert ranks (_experts)
        ep=ep,
        dp_replicate=hybrid,
        compile=compiled,
        tp=tp,
        pp=pp,
        cp=cp,
        sharding="fsdp" if shard > 1 else "none",
        impl="torch",
        sequence_parallel=tp > 1,  # torchtitan's TP plan shards the norms' sequence whenever tp > 1
        schedule=SCHEDULES[schedule_name],
        virtual_stages=virtual,
        stage_layers=stage_layers,
        microbatches=glob // (dp * micro),
        global_batch=glob,
        precision=precision,
        fp8_recipe=recipe or "tensorwise",
        checkpoint_activations=recompute,
        # 'default' keeps the gathered weights for backward under a pipeline (torchtitan's parallelize)
        reshard_after_forward={"always": True, "never": False}.get(reshard, pp == 1),
    )
    opt = sec["optimizer"]
    optim = OptimConfig(
        lr=opt.take("lr", float, 8e-4),
        eps=opt.take("eps", float, 1e-8),
        beta1=opt.take("beta1", float, 0.9),
        beta2=opt.take("beta2", float, 0.95),
        weight_decay=opt.take("weight_decay", float, 0.1),
        clip=tr.take("max_norm", float, 1.0),
    )
    if opt.take("name", str, "AdamW") != "AdamW":
        notes.append(f"[optimizer] name = {opt.data['name']!r}: labkit's optimizer is AdamW (its state bytes priced)")
    sec["float8"].skip("filter_fqns")  # which linears stay bf16: listed below when fp8 is on
    # read only with fp8 on; off, the [float8] fields are all listed below as unused
    gather8 = sec["float8"].take("enable_fsdp_float8_all_gather", bool, False) if fp8 else None
    if fp8 and shard > 1 and not gather8:
        notes.append(
            "[float8] enable_fsdp_float8_all_gather = false: labkit's fp8 gathers FSDP's weights in fp8, so "
            "its dp all-gather bytes are half the job's"
        )
    if fp8 and sec["float8"].has("filter_fqns"):
        notes.append(
            f"[float8] filter_fqns = {sec['float8'].data['filter_fqns']!r}: labkit's fp8 covers every "
            "block linear and no others (the head stays bf16 either way)"
        )
    for s in sec.values():
        notes += s.rest(NOT_LAID_OUT if s.where != "[float8]" or fp8 else "float8 is off ([model] converters)")
    for s in sorted(set(doc) - set(sec)):
        notes.append(f"[{s}] {', '.join(doc[s]) if isinstance(doc[s], dict) else repr(doc[s])}: {NOT_LAID_OUT}")
    stack = "compile" if compiled else "eager"
    return Job(
        cfg, model, str(path), READER_PY if path.suffix == ".py" else READER, optim, tuple(notes),
        stack=stack, stack_reason=stack_reason,
    )  # fmt: skip


def _compiled(tr: Fields, comp: Fields) -> tuple[bool, str]:
    """(whether the blocks run through torch.compile, the stack's reason): [training] compile
    (job_config.py @ 000204a4) or [compile] enable with 'model' in its components (@ 08b8b244)."""
    old = tr.take("compile", bool, False)
    enable, parts = comp.take("enable", bool, False), comp.take("components", list, ["model", "loss"])
    if old:
        return True, "[training] compile = true: torch.compile per block, the compile stack's measured pace"
    if enable and "model" in parts:
        return True, f"[compile] enable = true, components = {parts}: the compile stack's measured pace"
    why = "[compile] compiles the loss alone" if enable else "no torch.compile in the file"
    return False, f"{why}: eager PyTorch, the eager stack's measured pace"


def _experts(ep: int, rep: int, shard: int, notes: list[str]) -> None:
    """torchtitan's expert ranks as labkit lays them out: inside the data-parallel ranks (Megatron's EP | DP)."""
    if shard % ep or rep > 1:
        raise ConfigError(
            [
                f"[parallelism] expert_parallel_degree = {ep} with data_parallel_shard_degree = {shard} and "
                f"data_parallel_replicate_degree = {rep}: labkit lays experts inside the shard ranks, so ep must "
                "divide data_parallel_shard_degree, without replicas (torchtitan may also borrow tensor-parallel ranks)"
            ]
        )
    notes.append(
        f"[parallelism] expert_parallel_degree = {ep}: torchtitan shards the experts over data_parallel_shard / "
        "ep ranks and every other weight over data_parallel_shard; labkit shards every weight over its dp"
    )
