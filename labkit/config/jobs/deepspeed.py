"""DeepSpeed's JSON config + a Hugging Face config.json -> labkit (labkit/config/jobs/__init__.py).

Follows DeepSpeed at commit cbf3d661: deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig: the
stage and its sub-options, their defaults) and deepspeed/runtime/config.py (the batch: train_batch_size
= train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks, any two giving
the third; bf16 / fp16 "enabled"; gradient_clipping; activation_checkpointing; tensor_parallel's
autotp_size). The model is the config.json's (ModelConfig.from_hf); DeepSpeed's JSON holds none.

Hugging Face's Trainer writes "auto" for fields it fills from its own arguments
(transformers/integrations/deepspeed.py): here the caller gives those that shape the layout
(micro_batch, grad_accum, precision), and the others are listed in the notes. DeepSpeed's
activation_checkpointing section configures its checkpointing API; whether blocks are recomputed
is the model code's choice (HF's gradient_checkpointing_enable), so the section's presence is read
as full recomputation, with a note saying so.
"""

from __future__ import annotations

import json

from labkit.config import ModelConfig, OptimConfig, ParallelConfig
from labkit.config.choices import ConfigError
from labkit.config.jobs.fields import Fields
from labkit.config.jobs.job import Job, need_world, world_problem

READER = "DeepSpeed JSON (runtime/zero/config.py @ cbf3d661) + Hugging Face config.json"
STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}
AUTO = "auto"
GIVEN = {"train_micro_batch_size_per_gpu": "micro_batch", "gradient_accumulation_steps": "grad_accum"}
"""An "auto" batch field -> the reader's keyword that gives its value."""


def _load(path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError([f"{path.name} is not valid JSON ({e}); fix the line it names"]) from None
    if not isinstance(doc, dict):
        raise ConfigError([f"{path.name} holds a {type(doc).__name__}, not a DeepSpeed config object"])
    return doc


def _batch(top: Fields, dp: int, given: dict) -> tuple[int, int, int]:
    """(global batch, micro batch per GPU, accumulation steps), as DeepSpeed completes them."""
    vals = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        v = top.data.get(key)
        top.skip(key)
        if v == AUTO:
            kw = GIVEN.get(key)
            if kw is None or given.get(kw) is None:
                if kw is None:  # train_batch_size: the Trainer computes it from the other two
                    continue
                raise ConfigError(
                    [
                        f'{key} = "auto": Hugging Face\'s Trainer fills it from its arguments; '
                        f"give it ({kw}=N, on the command line --{kw.replace('_', '-')} N)"
                    ]
                )
            v = given[kw]
        elif v is not None and given.get(GIVEN.get(key, "")) not in (None, v):
            # a value given beside a file that fixes it: one of the two is wrong
            raise ConfigError([f"{GIVEN[key]}={given[GIVEN[key]]} (given) contradicts {key} = {v} (the file)"])
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError([f"{key} = {v!r} must be a positive whole number"])
            vals[key] = v
    tb, mb, ga = (
        vals.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    )
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * dp:
            raise ConfigError(
                [
                    f"train_batch_size = {tb} is not train_micro_batch_size_per_gpu ({mb}) x "
                    f"gradient_accumulation_steps ({ga}) x data-parallel GPUs ({dp}) = {mb * ga * dp}"
                ]
            )
    elif tb is not None:  # DeepSpeed derives the missing one(s); accumulation 1 when both are missing
        known = mb or ga or 1
        if tb % (known * dp):
            name = "train_micro_batch_size_per_gpu" if mb else "gradient_accumulation_steps"
            raise ConfigError(
                [f"train_batch_size = {tb} is not divisible by {name} ({known}) x data-parallel GPUs ({dp})"]
            )
        mb, ga = (mb, tb // (mb * dp)) if mb else (tb // ((ga or 1) * dp), ga or 1)
    else:  # no global batch: DeepSpeed's defaults, 1 sequence per GPU and no accumulation
        mb, ga = mb or 1, ga or 1
    return mb * ga * dp, mb, ga


def _precision(top: Fields, given: dict, notes: list[str]) -> str:
    on = {}
    for key in ("bf16", "fp16"):
        sec = Fields(top.data.get(key) or {}, key)
        top.skip(key)
        on[key] = sec.data.get("enabled", False)
        sec.skip("enabled")
        notes += sec.rest("loss scaling and its options: labkit's mixed precision has none")
    if AUTO in on.values() and given.get("precision") is None:
        raise ConfigError(
            [
                'bf16/fp16 "enabled": "auto": Hugging Face\'s Trainer sets it from --bf16/--fp16; '
                "give precision='bf16' or 'fp32' (on the command line --precision)"
            ]
        )
    if given.get("precision") is not None and AUTO in on.values():
        return given["precision"]
    if on["bf16"] is True and on["fp16"] is True:
        raise ConfigError(['bf16 "enabled": true and fp16 "enabled": true: DeepSpeed takes one; disable the other'])
    if on["fp16"] is True:  # the same 2 bytes a value; the loss scaler is not modelled
        notes.append("fp16 enabled: labkit prices fp16 as bf16 (the same bytes)")
    written = "bf16" if True in on.values() else "fp32"
    if given.get("precision") not in (None, written):  # the file says; a different word beside it is a mistake
        raise ConfigError(
            [f'precision={given["precision"]!r} (given) contradicts the file\'s bf16/fp16 "enabled" = {written}']
        )
    return written


def read(path, hf, gpus: int | None = None, seq: int | None = None, **given) -> Job:
    """The Job of a DeepSpeed JSON and the model's config.json. `gpus`: the GPU count (DeepSpeed's
    file leaves it to the launcher, unless all three batch fields fix it); `seq`: the training
    sequence (default config.json's max_position_embeddings); `given`: values of "auto" fields
    (micro_batch, grad_accum, precision)."""
    doc = _load(path)
    unknown = set(given) - {"micro_batch", "grad_accum", "precision"}
    if unknown:
        raise ConfigError(
            [f"read_job got {sorted(unknown)}; the DeepSpeed reader takes micro_batch, grad_accum, precision, seq"]
        )
    # DeepSpeed's JSON holds no model: the architecture is the config.json's, refused by name where labkit lacks it
    model = ModelConfig.from_hf(str(hf), seq=seq)
    notes: list[str] = (
        []
        if seq
        else [
            f"seq = {model.seq}: config.json's max_position_embeddings (the longest "
            "context); give seq= for the training sequence"
        ]
    )
    top = Fields(doc, "")
    zero = Fields(doc.get("zero_optimization") or {}, "zero_optimization")
    top.skip("zero_optimization")
    stage = zero.take("stage", int, 0)
    if stage not in STAGES:
        raise ConfigError([f"zero_optimization stage = {stage!r} is not 0, 1, 2 or 3"])
    # offload changes where bytes live, not what a step computes: the layout stands, the GPU memory is an upper bound
    for key in ("offload_optimizer", "offload_param"):
        dev = (zero.take(key, dict, {}) or {}).get("device", "none")
        if dev != "none":
            what = "the optimizer's state and step" if key == "offload_optimizer" else "the parameters"
            notes.append(
                f"zero_optimization {key} device = {dev!r}: {what} live on the {dev}; labkit prices them "
                "on the GPU, so its GPU memory is more than the job's"
            )
    hpz = zero.take("zero_hpz_partition_size", int, 1)
    if hpz > 1:
        raise ConfigError(
            [
                f"zero_optimization zero_hpz_partition_size = {hpz} (ZeRO++ hierarchical partitions): "
                "labkit's mesh has one data-parallel dim; set it to 1"
            ]
        )
    tpsec = Fields(doc.get("tensor_parallel") or {}, "tensor_parallel")
    top.skip("tensor_parallel")
    # DeepSpeed's AutoTP (training) splits the linears Megatron's way over autotp_size ranks
    tp = tpsec.take("autotp_size", int, 1)
    notes += tpsec.rest("not represented")

    # the GPU count: given, or fixed by the three batch fields together
    nums = [doc.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    implied = None
    if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in nums):
        if nums[0] % (nums[1] * nums[2]):
            raise ConfigError(
                [
                    f"train_batch_size = {nums[0]} is not divisible by train_micro_batch_size_per_gpu "
                    f"({nums[1]}) x gradient_accumulation_steps ({nums[2]})"
                ]
            )
        implied = nums[0] // (nums[1] * nums[2]) * tp
    found = world_problem(gpus, implied, "train_batch_size / (micro x accumulation) x autotp_size")
    if found:
        raise ConfigError(found)
    world = need_world(gpus, implied, "the DeepSpeed config")
    if world % tp:
        raise ConfigError([f"gpus={world} is not divisible by tensor_parallel autotp_size = {tp}"])
    glob, micro, accum = _batch(top, world // tp, given)
    precision = _precision(top, given, notes)

    ac = Fields(doc.get("activation_checkpointing") or {}, "activation_checkpointing")
    top.skip("activation_checkpointing")
    # the section configures deepspeed.checkpointing; a model that calls it checkpoints each block
    recompute = "full" if "activation_checkpointing" in doc else False
    if recompute:
        notes.append(
            "activation_checkpointing: read as every block recomputed ('full'); the model code decides "
            "(HF: gradient_checkpointing_enable)"
        )
    notes += ac.rest("DeepSpeed's checkpointing options (partitioning or CPU copies of checkpoints): not represented")

    opt = Fields(doc.get("optimizer") or {}, "optimizer")
    top.skip("optimizer")
    params = Fields(opt.take("params", dict, {}) or {}, "optimizer params")
    kind = opt.take("type", str, "AdamW")
    if kind.lower() not in ("adamw", "adam"):
        notes.append(f"optimizer type = {kind!r}: labkit's optimizer is AdamW (its state bytes priced)")
    values = {k: params.data.get(k) for k in ("lr", "betas", "eps", "weight_decay")}
    params.skip(*values)
    auto = [k for k, v in values.items() if v == AUTO]
    if auto:
        notes.append(f"optimizer params {', '.join(auto)} = \"auto\": the HF Trainer's; labkit's defaults stand")
    num = {k: v for k, v in values.items() if v is not None and v != AUTO}
    betas = num.get("betas") or (0.9, 0.999)  # torch.optim.AdamW's defaults, which DeepSpeed passes on
    clip = doc.get("gradient_clipping")
    top.skip("gradient_clipping")
    optim = OptimConfig(
        lr=float(num.get("lr", 1e-3)),
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(num.get("eps", 1e-8)),
        weight_decay=float(num.get("weight_decay", 0.01)),
        clip=float(clip) if isinstance(clip, (int, float)) and not isinstance(clip, bool) else 1.0,
    )
    if clip == AUTO:
        notes.append("gradient_clipping = \"auto\": the HF Trainer's max_grad_norm; labkit's clip 1.0 stands")
    notes += params.rest("not represented") + opt.rest("not represented")
    notes += zero.rest("a ZeRO implementation detail (buckets, overlap, thresholds): not represented")
    notes += top.rest("not represented (labkit's layout and estimate do not use it)")
    cfg = ParallelConfig(
        dp=world // tp,
        tp=tp,
        sharding=STAGES[stage],
        sequence_parallel=False,
        microbatches=accum,
        global_batch=glob,
        precision=precision,
        checkpoint_activations=recompute,
    )
    # labkit's per-GPU micro batch is implied: global_batch / (dp x microbatches) = the file's micro batch
    assert glob // (cfg.dp * cfg.microbatches) == micro
    # DeepSpeed runs the Hugging Face model's own PyTorch modules
    why = "DeepSpeed trains the Hugging Face model's PyTorch modules: eager"
    return Job(cfg, model, str(path), READER, optim, tuple(notes), stack="eager", stack_reason=why)
