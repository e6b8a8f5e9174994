"""torchtitan's own Llama 3 and its own parallelize_llama, on the Lab's CPU engines (notebook 14,
tests/test_torchtitan.py): `build` is `Lab.verify`'s build, `parallelize` its parallelize, `step` its
rank step, `train` a function for `Lab.measure`. Needs the torchtitan extra (README: `pip install
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
The loss is torchtitan's (components/loss.py cross_entropy_loss: summed, vocab-parallel on tp's
sharded logits), divided by the global batch's tokens as its trainer does.
"""

from __future__ import annotations

import dataclasses
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
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import llama3_configs, parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from labkit.config import ConfigError, ParallelConfig
from labkit.engines.tracking import track

BACKEND = "partial_dtensor"
"""torchtitan's SPMD backend that torch 2.13.0's FSDP2 runs (module docstring, 2)."""


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
    """A labkit layout as torchtitan's configs: the inverse of labkit/config/jobs/torchtitan.py."""
    if cfg.pp > 1 or cfg.ep > 1 or cfg.dp_replicate > 1:
        raise ConfigError(["pp > 1, ep > 1 and HSDP are not wired to torchtitan here; FSDP x TP (+ SP) x CP are"])
    par = ParallelismConfig(
        data_parallel_shard_degree=cfg.dp,
        tensor_parallel_degree=cfg.tp,
        context_parallel_degree=cfg.cp,
        enable_sequence_parallel=cfg.sequence_parallel,
        fsdp_reshard_after_forward="default" if cfg.reshard_after_forward else "never",
        spmd_backend=BACKEND,
    )
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[cfg.precision]
    training = TrainingConfig(mixed_precision_param=dtype, mixed_precision_reduce="float32")
    ac = {"full": FullAC.Config(), "op": SelectiveAC.Config(), "none": None}.get(cfg.recompute)
    if cfg.recompute not in ("full", "op", "none"):
        raise ConfigError([f"recompute {cfg.recompute!r}: torchtitan checkpoints whole blocks ('full') or per op"])
    dims = ParallelDims.from_config(par, dist.get_world_size())
    return dims, par, training, ac


def parallelize(model: torch.nn.Module, mesh, cfg: dict) -> torch.nn.Module:
    """torchtitan's parallelize_llama on this rank, the layout `cfg` (a ParallelConfig's dict); the
    labkit `mesh` Lab.verify made is not used: ParallelDims builds torchtitan's own."""
    titan_dims.device_type = "cpu"  # (1)
    titan_utils.set_spmd_backend(BACKEND)  # the loss reads it, as the trainer sets it
    dims, par, training, ac = titan_configs(ParallelConfig.from_dict(cfg))
    dims.build_mesh()
    model = parallelize_llama(
        model, parallel_dims=dims, training=training, parallelism=par, compile_config=CompileConfig(),
        ac_config=ac, dump_folder=tempfile.gettempdir(),
    )  # fmt: skip
    for m in model.modules():  # (4)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.parallel_dims = dims  # train() names the collectives by its meshes
    return model


def batch(step: int, rows: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: random tokens, the same on every process; (inputs, labels) shifted by one."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)  # (b, s + 1)
    return tokens[:, :-1], tokens[:, 1:]


def loss(model, data) -> torch.Tensor:
    """The mean token loss of `data`: torchtitan's summed cross-entropy over its tokens."""
    inputs, labels = data
    return cross_entropy_loss(model(inputs), labels) / labels.numel()


def step(model, data, ctx):
    """Lab.verify's rank step as torchtitan's trainer takes it: this rank's slice, its summed loss over the
    global batch's tokens (FSDP sums the gradients, 4), backward; returns the slice's mean loss."""
    inputs, labels = ctx.shard(data)
    total = cross_entropy_loss(model(inputs), labels)
    (total / data[1].numel()).backward()
    return total.detach() / labels.numel()


def train(cfg: dict, flavor: str, seq: int, rows: int, steps: int, clip: float, lr: float) -> int:
    """For Lab.measure: build, parallelize, then `steps` steps of AdamW (torchtitan's default_adamw's betas,
    eps and decay) with torchtitan's gradient clipping; returns the parameter count."""
    torch.manual_seed(0)
    model = build(flavor, seq, ParallelConfig.from_dict(cfg).sequence_parallel)
    model = parallelize(model, None, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    dims = model.parallel_dims
    track(model, opt, dims.get_mesh(["fsdp", "tp"]) if dims.tp_enabled else dims.get_mesh("fsdp"))
    vocab = model.config.vocab_size
    per = rows // dims.dp_shard
    coord = dims.get_mesh("fsdp").get_local_rank()
    for s in range(steps):
        inputs, labels = batch(s, rows, seq, vocab)
        mine = slice(coord * per, (coord + 1) * per)
        total = cross_entropy_loss(model(inputs[mine]), labels[mine])
        (total / labels.numel()).backward()
        titan_utils.clip_grad_norm_(list(model.parameters()), clip, foreach=True)
        opt.step()
        opt.zero_grad()
    return sum(p.numel() for p in model.parameters())
