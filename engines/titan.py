"""torchtitan's own Llama 3 and its own parallelize_llama, on the Lab's CPU engines (notebook 14,
tests/test_torchtitan.py): `build` is `Lab.verify`'s build, `parallelize` its parallelize, `step` its
rank step, `train` a function for `Lab.measure`; FSDP x TP + SP, and FSDP x PP through its own
pipeline_llm and a one-stage schedule (1F1B, GPipe). Needs the torchtitan extra (README: `pip install
--no-deps torchtitan==0.3.0 && pip install -e .[torchtitan]`).

The model is torchtitan 0.3.0's registry entry (`llama3_configs[flavor]`, models/llama3/__init__.py),
built by its own Config.build() and init_weights(); the layout is a labkit ParallelConfig read from
a torchtitan TOML (read_job), handed to torchtitan as its ParallelDims, ParallelismConfig and
TrainingConfig; parallelize_llama applies its own TP plan (sharding.py), activation checkpointing
and FSDP2 (distributed/fsdp.py). On a CPU with gloo, four settings differ from a GPU run, each
because a call of torchtitan's fails there otherwise:

  1. ParallelDims.build_mesh: init_device_mesh(device_type) with torchtitan.tools.utils.device_type,
     which falls back to "cuda" without an accelerator; fully_shard then calls
     torch.cuda.current_device() ("Torch not compiled with CUDA enabled"). Set to "cpu".
  2. ParallelismConfig.spmd_backend: its default "spmd_types" hands fully_shard plain tensors with
     dp_mesh_dims, and torch 2.13.0's FSDPParam._init_sharding_spec raises ValueError ("When
     dp_mesh_dims is provided, all parameters must be DTensors"): that backend needs a newer PyTorch
     (torchtitan's README: the nightly). "partial_dtensor", its other backend: DTensor TP + FSDP2.
  3. The attention kernel: FlexAttention ("flex", the default) raises NotImplementedError in backward
     on CPU (torch's flex_attention._validate_device), VarlenAttention calls
     aten::_flash_attention_forward, which has no CPU kernel, and get_attention_config("sdpa") is
     refused for language models (it cannot mask documents apart). With one document per sequence
     causal SDPA is the same attention: torchtitan's own ScaledDotProductAttention module, swapped
     into each block's config before build (positions and masks left None).
  4. FSDP's reduce-scatter: apply_fsdp_to_decoder sets gradient_divide_factor 1.0 (the trainer divides
     the summed loss by the global token count), which FSDP2 sends as ReduceOp.PREMUL_SUM(1.0); gloo
     raises "Cannot use ReduceOp.PREMUL_SUM with Gloo". set_force_sum_reduction_for_comms(True): SUM,
     then a divide by 1.0, the same numbers.
Context parallelism does not run on a CPU: torchtitan's apply_cp_to_forward hands SDPA q, k and v
as sequence-sharded DTensors, and on a CPU SDPA is aten._scaled_dot_product_flash_attention_for_cpu,
for which DTensor has no sharding strategy (NotImplementedError; the CP dispatcher covers the CUDA
flash, efficient and cuDNN kernels). The loss is torchtitan's (components/loss.py cross_entropy_loss:
summed, vocab-parallel on tp's sharded logits), divided by the global batch's tokens as its trainer does.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_dims
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as titan_utils
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs, parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from labkit.config import ConfigError, ParallelConfig
from labkit.engines.tracking import track

BACKEND = "partial_dtensor"
"""torchtitan's SPMD backend that torch 2.13.0's FSDP2 runs (module docstring, 2)."""
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe"}
"""labkit's schedule names -> torchtitan's, for the schedules of one stage per rank (one model part,
named as build() named it, so Lab.verify reads it whole)."""


def model_config(flavor: str, seq: int, sequence_parallel: bool):
    """torchtitan's Llama3Model.Config of `flavor`, set up as its trainer sets it (Llama3Model.Config.
    update_from_config: the TP plan, the RoPE cache at the training length), attention on SDPA (3)."""
    cfg = llama3_configs[flavor](attn_backend="flex")
    for block in cfg.layers:
        block.attention.inner_attention = ScaledDotProductAttention.Config()
        block.attention.rope = dataclasses.replace(block.attention.rope, max_seq_len=seq)
    set_llama3_sharding_config(cfg, enable_sp=sequence_parallel)
    return cfg


def build(flavor: str, seq: int, sequence_parallel: bool) -> torch.nn.Module:
    """The model with torchtitan's own initialisation, drawn from torch's global generator (seeded by
    the caller: Lab.verify seeds the reference and every rank alike)."""
    titan_utils.set_spmd_backend(BACKEND)
    model = model_config(flavor, seq, sequence_parallel).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def titan_configs(cfg: ParallelConfig) -> tuple[ParallelDims, ParallelismConfig, TrainingConfig, object]:
    """A labkit layout as torchtitan's configs: the inverse of labkit/config/jobs/torchtitan/."""
    if cfg.cp > 1:
        raise ConfigError(
            [f"cp={cfg.cp}: torchtitan's context parallelism runs SDPA on sequence-sharded DTensors, and on a CPU "
             "that is aten._scaled_dot_product_flash_attention_for_cpu, which has no DTensor sharding strategy"]
        )  # fmt: skip
    if cfg.ep > 1 or cfg.dp_replicate > 1 or (cfg.pp > 1 and cfg.schedule not in SCHEDULES):
        raise ConfigError(
            [f"schedule {cfg.schedule!r}, ep={cfg.ep}, dp_replicate={cfg.dp_replicate}: wired here are FSDP x TP "
             f"(+ SP) and FSDP x PP with a schedule of one stage per rank {sorted(SCHEDULES)}"]
        )  # fmt: skip
    local = cfg.global_batch // cfg.dp  # a data rank's rows per step: the pipeline's microbatches split them
    par = ParallelismConfig(
        data_parallel_shard_degree=cfg.dp,
        tensor_parallel_degree=cfg.tp,
        pipeline_parallel_degree=cfg.pp,
        pipeline_parallel_schedule=SCHEDULES.get(cfg.schedule, "1F1B"),
        pipeline_parallel_microbatch_size=local // cfg.microbatches,
        enable_sequence_parallel=cfg.sequence_parallel,
        fsdp_reshard_after_forward="default" if cfg.reshard_after_forward else "never",
        spmd_backend=BACKEND,
    )
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(cfg.precision)
    if dtype is None:  # torchtitan's float8 converter is torchao's CUDA kernels
        raise ConfigError([f"precision {cfg.precision!r}: on the CPU engines torchtitan trains in fp32 or bf16"])
    training = TrainingConfig(local_batch_size=local, mixed_precision_param=dtype, mixed_precision_reduce="float32")
    rc = cfg.recomputation
    if rc.attention_only:  # 'selective': the attention core alone, for which torchtitan has no policy
        raise ConfigError([f"recompute {cfg.recompute!r}: torchtitan checkpoints whole blocks ('full') or per op"])
    ac = FullAC.Config() if rc.keeps_input_only else (SelectiveAC.Config() if rc.per_op else None)
    dims = ParallelDims.from_config(par, dist.get_world_size())
    return dims, par, training, ac


def parallelize(model: torch.nn.Module, mesh, cfg: dict) -> torch.nn.Module:
    """torchtitan's parallelize_llama on this rank (under a pipeline: its pipeline_llm, which splits the
    model into this rank's stage and parallelizes it), the layout `cfg` (a ParallelConfig's dict); the
    labkit `mesh` Lab.verify made is not used: ParallelDims builds torchtitan's own."""
    titan_dims.device_type = "cpu"  # (1)
    titan_utils.set_spmd_backend(BACKEND)  # the loss reads it, as the trainer sets it
    layout = ParallelConfig.from_dict(cfg)
    dims, par, training, ac = titan_configs(layout)
    dims.build_mesh()
    # never compiled here: compile changes the activations held, not the weights, gradients or collectives
    common = dict(parallel_dims=dims, training=training, parallelism=par, compile_config=CompileConfig(),
                  ac_config=ac, dump_folder=tempfile.gettempdir())  # fmt: skip
    schedule = None
    if layout.pp > 1:
        loss_fn = functools.partial(_microbatch_loss, rows=layout.global_batch)
        schedule, parts, _, _ = pipeline_llm(
            model, device=torch.device("cpu"), model_config=model.config, parallelize_fn=parallelize_llama,
            loss_fn=loss_fn, **common,
        )  # fmt: skip
        (model,) = parts  # one stage per rank: its modules keep build()'s names
    else:
        model = parallelize_llama(model, **common)
    for m in model.modules():  # (4)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.parallel_dims, model.pp_schedule = dims, schedule  # for the rank step and train()
    return model


def _microbatch_loss(pred, labels, rows: int):
    """A pipeline microbatch's loss as torchtitan's trainer gives it: summed, over the global batch's tokens."""
    return cross_entropy_loss(pred, labels) / (rows * labels.shape[1]), {}


def forward_backward(model, inputs, labels, rows: int):
    """This rank's forward and backward on its rows, as torchtitan's trainer runs them; the mean loss of its
    rows, or None on a pipeline stage that computes none."""
    if model.pp_schedule is None:
        total = cross_entropy_loss(model(inputs), labels)
        (total / (rows * labels.shape[1])).backward()
        return total.detach() / labels.numel()
    dims, losses = model.parallel_dims, []
    pp = dims.get_mesh("pp")
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    if first:
        model.pp_schedule.step(inputs, target=labels if last else None, losses=losses)
    else:
        model.pp_schedule.step(target=labels if last else None, losses=losses)
    # each microbatch's loss is over the global batch's tokens: back to this rank's rows' mean
    return torch.stack(losses).sum().detach() * rows / labels.shape[0] if last else None


def batch(step: int, rows: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: random tokens, the same on every process; (inputs, labels) shifted by one."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)  # (b, s + 1)
    return tokens[:, :-1], tokens[:, 1:]


def loss(model, data) -> torch.Tensor:  # the reference's: the whole batch in one process
    """The mean token loss of `data`: torchtitan's summed cross-entropy over its tokens."""
    inputs, labels = data
    return cross_entropy_loss(model(inputs), labels) / labels.numel()


def step(model, data, ctx):
    """Lab.verify's rank step as torchtitan's trainer takes it: this rank's slice, its summed loss over the
    global batch's tokens (FSDP sums the gradients, 4), backward; returns the slice's mean loss."""
    inputs, labels = ctx.shard(data)
    return forward_backward(model, inputs, labels, data[1].shape[0])


def train(cfg: dict, flavor: str, seq: int, steps: int, clip: float, lr: float) -> int:
    """For Lab.measure: build, parallelize, then `steps` steps of AdamW (torchtitan's default_adamw's betas,
    eps and decay) with torchtitan's gradient clipping; returns how many parameter tensors this rank holds
    (AdamW keeps a 4-byte step counter for each; torchtitan fuses q, k and v into one)."""
    layout = ParallelConfig.from_dict(cfg)
    torch.manual_seed(0)
    model = parallelize(build(flavor, seq, layout.sequence_parallel), None, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    dims = model.parallel_dims
    names = [d for d, on in (("pp", dims.pp_enabled), ("fsdp", True), ("tp", dims.tp_enabled)) if on]
    track(model, opt, dims.get_mesh(names))  # the collectives named by torchtitan's mesh dims
    rows, per = layout.global_batch, layout.global_batch // layout.dp
    coord = dims.get_mesh("fsdp").get_local_rank()
    for s in range(steps):
        inputs, labels = batch(s, rows, seq, model.config.vocab_size)
        mine = slice(coord * per, (coord + 1) * per)
        forward_backward(model, inputs[mine], labels[mine], rows)
        titan_utils.clip_grad_norm_(
            list(model.parameters()), clip, foreach=True, pp_mesh=dims.get_mesh("pp") if dims.pp_enabled else None
        )
        opt.step()
        opt.zero_grad()
    return len(list(model.parameters()))
