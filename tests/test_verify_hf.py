"""lab.verify on Hugging Face models built from a config (no download): Llama with GQA and GPT-2
with its tied head under DDP, FSDP2 and a 2-stage pipeline, Llama under FSDP2 + TP with SP,
Mixtral under DDP and FSDP2; and the pipeline's tied-embedding bug. Tiny configs, 2 steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("transformers")

V, S, B = 64, 8, 8  # vocabulary, sequence, global batch


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per key/value head
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # no dropout: the reference and the ranks must compute the same function
    cfg = GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return GPT2LMHeadModel(cfg)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(cfg)


def batch(step):
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, V, (B, S + 1), generator=g)


def loss(model, b):
    """Next-token cross-entropy, positions given (so a sequence-sharded stream still knows them)."""
    positions = torch.arange(S).unsqueeze(0)
    logits = model(input_ids=b[:, :-1], position_ids=positions).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())


def ddp(model, mesh):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, process_group=mesh.get_group("dp"))


def blocks(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


@pytest.mark.parametrize("family", [llama, gpt2, mixtral])
@pytest.mark.parametrize("plan", [ddp, fsdp2])
def test_hf_models_under_ddp_and_fsdp2_are_right(lab, family, plan):
    report = lab.verify(family, plan, {"dp": 4}, batch, loss)
    report.assert_ok()
    assert len(report.df) == len(list(family().parameters()))  # every tensor judged (GPT-2's tied head once)


# -- Llama: FSDP2 over dp, TP with sequence parallelism over tp (torchtitan's plan for its Llama) -------
def llama_tp_sp(model, mesh, norms=True):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = mesh["tp"]
    # between blocks the residual stream is (b, s/tp, h), sharded on the sequence, as local tensors
    parallelize_module(
        model,
        tp,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(use_local_output=True),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for block in model.model.layers:
        plan = {
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
        if norms:
            plan["input_layernorm"] = plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
        parallelize_module(block, tp, plan)
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def loss_parallel_step(model, b, ctx):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        out = ctx.loss(model, ctx.shard(b))
        out.backward()
    return out


def test_llama_under_fsdp2_and_tp_with_sp_is_right(lab):
    lab.verify(llama, llama_tp_sp, {"dp": 2, "tp": 2}, batch, loss, step=loss_parallel_step).assert_ok()


def test_llama_with_its_norms_outside_sp_names_a_norm(lab):
    report = lab.verify(
        llama,
        lambda m, mesh: llama_tp_sp(m, mesh, norms=False),
        {"dp": 2, "tp": 2},
        batch,
        loss,
        step=loss_parallel_step,
    )
    first = report.first()
    assert first.check == "gradient replicas" and first.tensor.endswith("layernorm.weight"), report.summary()


# -- a 2-stage pipeline (torch.distributed.pipelining, GPipe) with data parallelism over it ---------------
def stage_forward(model, stage: int):
    """One stage of a Llama or a GPT-2, cut in place so that every parameter keeps the name build()
    gave it: stage 0 embeds and runs block 0, stage 1 runs block 1, the final norm and the head."""
    import torch.nn as nn

    is_llama = hasattr(model, "model")
    body = model.model if is_llama else model.transformer
    layers = body.layers if is_llama else body.h
    layers[1 - stage] = nn.Module()  # the other stage's block: gone, the indices kept
    drop = (["lm_head", "norm"] if is_llama else ["lm_head", "ln_f"]) if stage == 0 else ["embed_tokens", "wte", "wpe"]
    for name in drop:  # GPT-2's stage 1 keeps the tied weight as lm_head.weight (build()'s transformer.wte.weight)
        for owner in (model, body):
            if hasattr(owner, name):
                setattr(owner, name, None)

    def forward(x):
        positions = torch.arange(S).unsqueeze(0)
        if stage == 0:
            x = body.embed_tokens(x) if is_llama else body.wte(x) + body.wpe(positions)
        kw = {"position_embeddings": body.rotary_emb(x, positions)} if is_llama else {}
        x = layers[stage](x, **kw)
        if stage == 1:
            x = model.lm_head(body.norm(x) if is_llama else body.ln_f(x))
        return x

    model.forward = forward
    return model


def pipelined(model, mesh, tie=True):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pp = mesh["pp"]
    stage = pp.get_local_rank()
    model = stage_forward(model, stage)
    pipe = PipelineStage(model, stage, 2, torch.device("cpu"), group=pp.get_group())
    model.schedule = ScheduleGPipe(
        pipe, n_microbatches=2, loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    )
    model.dp_group, model.pp_group, model.tie = mesh.get_group("dp"), pp.get_group(), tie
    return model


def pipeline_step(model, b, ctx):
    """GPipe over the stages (its loss_fn scales each microbatch's gradient by 1/2), then the
    gradients averaged over dp, and a tied weight's two copies summed over the stages."""
    mine = ctx.shard(b)
    losses = []
    if ctx.mesh["pp"].get_local_rank() == 0:
        model.schedule.step(mine[:, :-1])
    else:
        model.schedule.step(target=mine[:, 1:], losses=losses)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=model.dp_group)
            p.grad /= dist.get_world_size(model.dp_group)
    tied = getattr(model.transformer, "wte", None) if hasattr(model, "transformer") else None
    tied = (
        tied.weight
        if tied is not None
        else getattr(model.lm_head, "weight", None)
        if hasattr(model, "transformer")
        else None
    )
    if tied is not None and model.tie:
        dist.all_reduce(tied.grad, group=model.pp_group)  # the embedding's part plus the head's
    return sum(x.item() for x in losses) / len(losses) if losses else None


@pytest.mark.parametrize("family", [llama, gpt2])
def test_hf_models_in_a_2_stage_pipeline_are_right(lab, family):
    lab.verify(family, pipelined, {"dp": 2, "pp": 2}, batch, loss, step=pipeline_step).assert_ok()


def test_gpt2s_tied_embedding_drifting_across_stages_is_named(lab):
    report = lab.verify(
        gpt2, lambda m, mesh: pipelined(m, mesh, tie=False), {"dp": 2, "pp": 2}, batch, loss, step=pipeline_step
    )
    first = report.first()
    assert first.check == "gradient replicas" and first.tensor == "transformer.wte.weight", report.summary()
