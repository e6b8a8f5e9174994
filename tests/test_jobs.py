"""Your job, read (labkit/config/jobs): the published configs of tests/data/jobs/ read back to the
published parameter counts and the layouts their sources wrote; every field labkit does not
represent named in the notes; broken copies refused with the fields quoted; the CLI's --from."""

from __future__ import annotations

import pathlib

import pytest

from labkit import ConfigError, theory
from labkit.cli import main
from labkit.config.jobs import megatron as mg
from labkit.config.jobs import read_job
from labkit.theory.presets import LLAMA2_7B, LLAMA31_8B, LLAMA31_70B, LLAMA31_405B, PUBLISHED_PARAMS

DATA = pathlib.Path(__file__).parent / "data" / "jobs"
TT8, TT70, MEG, DS, HF = (
    DATA / f
    for f in (
        "llama3_8b.toml",
        "llama3_70b.toml",
        "megatron_llama31_405b.sh",
        "ds_config_zero3.json",
        "llama2_7b_config.json",
    )
)
DS_AUTO = {"micro_batch": 1, "grad_accum": 4, "precision": "bf16"}
"""What Hugging Face's Trainer would fill into the DeepSpeed config's "auto" batch and precision fields."""


def broken(tmp_path, src: pathlib.Path, old: str, new: str) -> pathlib.Path:
    """A copy of `src` with `old` replaced by `new` (which must be there: the copy is broken as meant)."""
    text = src.read_text()
    assert old in text, old
    out = tmp_path / src.name
    out.write_text(text.replace(old, new))
    return out


def test_torchtitan_configs_read_to_the_published_models_and_layouts():
    j8, j70 = read_job(TT8, gpus=64), read_job(TT70, gpus=64)
    assert j8.model == LLAMA31_8B and j70.model == LLAMA31_70B  # the flavors' FFN widths computed as torchtitan does
    assert j8.model.num_params() == PUBLISHED_PARAMS["llama3.1-8b"] == 8_030_261_248
    assert j70.model.num_params() == PUBLISHED_PARAMS["llama3.1-70b"]
    p = j8.parallel  # dp_shard = -1 over 64 GPUs, batch 1 each, selective AC 'op'
    assert (p.dp, p.tp, p.sharding, p.impl, p.global_batch, p.microbatches) == (64, 1, "fsdp", "torch", 64, 1)
    assert (p.precision, p.recompute, j8.optim.lr) == ("bf16", "op", 3e-4)
    p = j70.parallel  # 8-way TP (with its sequence parallelism), FSDP over the other 8, batch 8 each, full AC
    assert (p.dp, p.tp, p.sequence_parallel, p.global_batch, p.recompute) == (8, 8, True, 64, "full")
    for field in (
        "[checkpoint] enable_checkpoint",
        "[training] dataset",
        "[model] tokenizer_path",
        "[float8] enable_fsdp_float8_all_gather",
        "[lr_scheduler] warmup_steps",
        "[metrics] log_freq",
    ):
        assert any(field in n or (field.split()[0] in n and field.split()[1] in n) for n in j70.notes), field
    assert theory.estimate(p, j70.model).world == 64
    # compile = false, read (not a note): the eager stack, its reason quoting the file
    assert (p.compile, j70.stack) == (False, "eager") and "no torch.compile" in j70.stack_reason


def test_torchtitan_gpu_count_and_contradictions(tmp_path):
    with pytest.raises(ConfigError, match=r"data_parallel_shard_degree = -1 leaves the GPU count open"):
        read_job(TT8)
    with pytest.raises(ConfigError, match=r"gpus=60 is not divisible by .*tensor_parallel_degree \(8\)"):
        read_job(TT70, gpus=60)
    fixed = broken(tmp_path, TT70, "data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4")
    with pytest.raises(
        ConfigError, match=r"gpus=64 \(given\) contradicts the product of \[parallelism\]'s degrees = 32"
    ):
        read_job(fixed, gpus=64)
    assert read_job(fixed).world == 32  # the file says it all
    bad = broken(tmp_path, TT8, 'flavor = "8B"', 'flavor = "8B')
    with pytest.raises(ConfigError, match="llama3_8b.toml is not valid TOML"):
        read_job(bad, gpus=8)
    # HSDP: 2 replicas of shard groups of the GPUs left (torchtitan's dp_replicate x dp_shard)
    hsdp = read_job(
        broken(tmp_path, TT8, "data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"), gpus=64
    )
    assert (hsdp.parallel.dp, hsdp.parallel.dp_replicate, hsdp.parallel.sharding) == (64, 2, "fsdp")


def test_megatron_405b_reads_to_the_published_model_and_layout():
    job = read_job(MEG)  # the world from torchrun: 128 nodes x 8
    p, m = job.parallel, job.model
    assert (p.world, p.dp, p.tp, p.pp, p.cp, p.ep, job.gpus_per_node) == (1024, 8, 8, 8, 2, 1, 8)
    assert (p.schedule, p.virtual_stages, p.microbatches, p.global_batch) == ("interleaved", 8, 64, 512)
    # 126 layers + the embedding + the loss on 64 virtual stages of 2: the first and last hold one block
    assert p.stage_layers == (1,) + (2,) * 62 + (1,)
    assert (p.sharding, p.sequence_parallel, p.precision, p.recompute) == ("zero1", True, "bf16", "none")
    assert m.replace(vocab_divisible_by=None) == LLAMA31_405B
    assert m.num_params() == PUBLISHED_PARAMS["llama-405b"] == 405_853_388_800  # unpadded
    assert (m.vocab_divisible_by, m.padded_vocab(p.tp)) == (128, 129_024)  # Megatron pads 128 x TP
    assert theory.estimate(p, m).padding_params == 2 * (129_024 - 128_256) * 16_384  # embedding and untied head
    names = " ".join(job.notes)
    for arg in ("--overlap-grad-reduce", "--tp-comm-overlap", "--train-iters", "--master-addr", "--mock-data"):
        assert arg in names, arg
    assert "--tensor-model-parallel-size" not in names and "--num-query-groups" not in names


def test_megatron_argument_lists_experts_and_layouts():
    base = [
        "--num-layers",
        "8",
        "--hidden-size",
        "256",
        "--num-attention-heads",
        "8",
        "--seq-length",
        "128",
        "--vocab-size",
        "50257",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "64",
    ]
    gpt = mg.read(args=base + ["--tensor-model-parallel-size", "2"], gpus=8)
    mapped = mg.read(args=base + ["--tensor-model-parallel-size", "2", "--use-tp-pp-dp-mapping"], gpus=8)
    assert (gpt.parallel.order, mapped.parallel.order) == ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp")  # initialize.py
    assert (gpt.model.arch, gpt.model.ffn, gpt.model.tied, gpt.parallel.dp, gpt.parallel.microbatches) == (
        "gpt2",
        1024,
        True,
        4,
        8,
    )
    moe = [
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--disable-bias-linear",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--expert-model-parallel-size",
        "4",
    ]
    job = mg.read(args=base + moe + ["--tensor-model-parallel-size", "2"], gpus=16)
    # Megatron's DP of 8 holds the 4 expert ranks: labkit's dp 2 x ep 4, in its order tp-cp-ep-dp-pp
    assert (job.parallel.dp, job.parallel.ep, job.model.experts, job.model.ffn) == (2, 4, 8, 640)
    with pytest.raises(
        ConfigError, match="--expert-tensor-parallel-size 1 differs from --tensor-model-parallel-size 2"
    ):
        mg.read(args=base + moe + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], gpus=16)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 4 does not divide the data-parallel size 2"):
        mg.read(args=base + moe + ["--tensor-model-parallel-size", "4"], gpus=8)
    lay = mg.read(
        args=base + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|(ttt|)*2,tL"],
        gpus=2,
    )
    assert (lay.parallel.virtual_stages, lay.parallel.stage_layers, lay.parallel.schedule) == (
        2,
        (1, 3, 3, 1),
        "interleaved",
    )
    with pytest.raises(ConfigError, match="has 6 transformer layers; --num-layers is 8"):
        mg.read(
            args=base + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|tt|tL"],
            gpus=2,
        )


def test_megatron_contradictions_quote_the_arguments(tmp_path):
    bad = broken(tmp_path, MEG, "--global-batch-size 512", "--global-batch-size 500")
    with pytest.raises(
        ConfigError,
        match=r"--global-batch-size 500 is not divisible by --micro-batch-size 1 x the "
        r"data-parallel size 8 \(world 1024 / \(TP 8 x PP 8 x CP 2\)\)",
    ):
        read_job(bad)
    with pytest.raises(
        ConfigError, match=r"gpus=512 \(given\) contradicts torchrun's --nnodes x --nproc-per-node = 1024"
    ):
        read_job(MEG, gpus=512)
    bad = broken(tmp_path, MEG, "--context-parallel-size $CP", "--context-parallel-size 3")
    with pytest.raises(ConfigError, match="world 1024 GPUs is not divisible by --tensor-model-parallel-size 8 x"):
        read_job(bad)
    bad = broken(tmp_path, MEG, "    --disable-bias-linear \\\n", "")
    with pytest.raises(ConfigError, match="without --disable-bias-linear"):
        read_job(bad)
    bad = broken(tmp_path, MEG, "VPP=8", "VPP=3")
    with pytest.raises(ConfigError, match=r"--num-layers 126 \+ embedding \+ loss = 128 does not split evenly"):
        read_job(bad)


def test_deepspeed_zero3_with_the_hf_model():
    job = read_job(DS, hf=HF, gpus=8, **DS_AUTO)
    p = job.parallel
    assert job.model == LLAMA2_7B and job.model.num_params() == PUBLISHED_PARAMS["llama-7b"]
    assert (p.dp, p.sharding, p.microbatches, p.global_batch, p.precision) == (8, "zero3", 4, 32, "bf16")
    names = " ".join(job.notes)
    for field in (
        "offload_optimizer",
        "offload_param",
        "loss_scale_window",
        "scheduler",
        "stage3_max_live_parameters",
        "steps_per_print",
        "gradient_clipping",
    ):
        assert field in names, field
    with pytest.raises(ConfigError, match=r'train_micro_batch_size_per_gpu = "auto".*give it \(micro_batch=N'):
        read_job(DS, hf=HF, gpus=8, precision="bf16")
    with pytest.raises(ConfigError, match="it holds no model; give the model's Hugging Face config.json"):
        read_job(DS, gpus=8)


def test_deepspeed_contradictions(tmp_path):
    bad = broken(tmp_path, DS, '"train_batch_size": "auto"', '"train_batch_size": 64')
    with pytest.raises(
        ConfigError,
        match=r"train_batch_size = 64 is not train_micro_batch_size_per_gpu \(1\) x "
        r"gradient_accumulation_steps \(4\) x data-parallel GPUs \(8\) = 32",
    ):
        read_job(bad, hf=HF, gpus=8, **DS_AUTO)
    bad = broken(tmp_path, DS, '"stage": 3', '"stage": 4')
    with pytest.raises(ConfigError, match="stage = 4 is not 0, 1, 2 or 3"):
        read_job(bad, hf=HF, gpus=8, **DS_AUTO)
    bad = broken(tmp_path, DS, '"steps_per_print": 2000,', '"steps_per_print": 2000')
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_job(bad, hf=HF, gpus=8, **DS_AUTO)


@pytest.mark.parametrize(
    "args",
    [
        ["--from", str(TT70), "--gpus", "64"],
        ["--from", str(MEG)],
        [
            "--from",
            str(DS),
            "--hf",
            str(HF),
            "--gpus",
            "8",
            "--micro-batch",
            "1",
            "--grad-accum",
            "4",
            "--precision",
            "bf16",
        ],
    ],
    ids=["torchtitan", "megatron", "deepspeed"],
)
def test_cli_estimate_and_plan_from_a_job(capsys, args):
    assert main(["estimate", *args]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "step time on" in out and "not represented:" in out
    assert main(["plan", *args, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "your job's layout (" in out and "tokens/s/GPU" in out


def test_cli_refuses_a_broken_job_without_a_traceback(tmp_path, capsys):
    bad = broken(tmp_path, MEG, "--global-batch-size 512", "--global-batch-size 500")
    assert main(["estimate", "--from", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("labkit: ") and "--global-batch-size 500" in err and "Traceback" not in err
    assert main(["plan", "--from", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["estimate", "--from", str(TT8)]) == 2  # dp_shard = -1 and no --gpus
    assert "--gpus N" in capsys.readouterr().err


def test_torchtitan_pipeline_schedules_and_their_stages(tmp_path):
    pp = broken(tmp_path, TT70, "pipeline_parallel_degree = 1",
                'pipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"')  # fmt: skip
    p = read_job(pp, gpus=128).parallel  # a looped schedule: two stages per rank, torchtitan's default
    assert (p.dp, p.tp, p.pp, p.schedule, p.virtual_stages, p.microbatches, p.reshard_after_forward) == (
        4, 8, 4, "interleaved", 2, 8, False)  # fmt: skip
    assert main(["plan", "--from", str(pp), "--gpus", "128", "--top", "2"]) == 0
    bad = broken(tmp_path, pp, '"Interleaved1F1B"', '"LoopedBFS"')
    with pytest.raises(ConfigError, match="pipeline_parallel_schedule = 'LoopedBFS' is not one labkit runs"):
        read_job(bad, gpus=128)


@pytest.mark.parametrize("which", ["torchtitan-70b", "deepspeed-zero3"])
def test_a_job_shrunk_to_the_lab_trains_like_one_process(lab, ref_cache, which):
    """The job's structure (dims, sharding, impl, precision, recompute, GQA) on the session's 4 engines."""
    from labkit.config.jobs.shrink import shrink
    from labkit.oracle.checks import mismatches

    job = read_job(TT70, gpus=64) if which == "torchtitan-70b" else read_job(DS, hf=HF, gpus=8, **DS_AUTO)
    small = shrink(job, engines=lab.world)
    p = small.parallel
    assert p.sharding == job.parallel.sharding and p.precision == "bf16"
    assert small.world == (4 if which == "torchtitan-70b" else 2)  # tp 8 x dp 8 -> 2 x 2; dp 8 -> 2
    assert any(s.startswith("model layers:") for s in small.shrunk)  # what was shrunk is said
    res = lab.run(p, model=small.model, steps=2, return_params=True)
    ref = ref_cache(small.model, steps=2, global_batch=p.global_batch)  # fp32: bf16 is held to its bounds
    assert mismatches(res, ref) == []


def test_torchtitan_float8_and_what_labkit_prices_differently(tmp_path):
    fp8 = broken(tmp_path, TT8, '# converters = ["float8"]', 'converters = ["float8"]')
    job = read_job(fp8, gpus=64)
    assert job.parallel.precision == "fp8"
    assert any(n.startswith("[float8] enable_fsdp_float8_all_gather = false") for n in job.notes)
    assert any(n.startswith("[float8] filter_fqns") for n in job.notes)
    assert theory.evaluate(job.parallel, job.model, "h100").mfu > 0  # fp8 is priced on an fp8 GPU


def test_deepspeed_values_given_beside_the_file_must_agree(tmp_path):
    fixed = broken(tmp_path, DS, '"train_micro_batch_size_per_gpu": "auto"', '"train_micro_batch_size_per_gpu": 1')
    assert read_job(fixed, hf=HF, gpus=8, **DS_AUTO).parallel.global_batch == 32  # the same 1: fine
    with pytest.raises(ConfigError, match=r"micro_batch=2 \(given\) contradicts train_micro_batch_size_per_gpu = 1"):
        read_job(fixed, hf=HF, gpus=8, **{**DS_AUTO, "micro_batch": 2})
    bf16 = broken(tmp_path, DS, '"enabled": "auto"', '"enabled": false')
    with pytest.raises(ConfigError, match=r"precision='bf16' \(given\) contradicts the file's"):
        read_job(bf16, hf=HF, gpus=8, **DS_AUTO)
    with pytest.raises(ConfigError, match=r"\['vocab'\] do not apply to ds_config_zero3.json"):
        read_job(DS, hf=HF, gpus=8, vocab=1000)


def test_cli_flags_override_the_file(capsys):
    """A layout flag beside --from overrides the file (DeepSpeed's "auto" precision aside)."""

    def step_ms(*extra):
        assert main(["estimate", "--from", str(TT70), "--gpus", "64", *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step time on"))
        return float(line.split(": ")[1].split(" ms")[0].replace(",", ""))

    # compiled, as torchtitan runs float8 (eager, fp8's casts cost more than its matmuls save: the eager stack)
    bf16, fp8 = step_ms("--stack", "compile"), step_ms("--precision", "fp8", "--stack", "compile")
    assert fp8 < bf16  # the file's bf16 replaced: fp8 matmuls on an H100 are faster


def test_torchtitan_python_config_read_without_running_it(tmp_path, capsys):
    """torchtitan's newer train config (Python, tests/data/jobs/llama3_8b.py) reads as its TOML does."""
    py, toml = read_job(DATA / "llama3_8b.py", gpus=64), read_job(TT8, gpus=64)
    assert (py.parallel, py.model, py.optim) == (toml.parallel, toml.model, toml.optim)
    assert any(n.startswith("[validation] dataset, freq, steps") for n in py.notes)
    code = broken(
        tmp_path, DATA / "llama3_8b.py", "OptimizersContainer.Config(lr=3e-4)", "OptimizersContainer.Config(lr=LR)"
    )
    with pytest.raises(ConfigError, match="optimizer.lr = LR is code, not a value"):
        read_job(code, gpus=64)
    bad = broken(
        tmp_path, DATA / "llama3_8b.py", "default_config = Trainer.Config(", "default_config = Trainer.Config(("
    )
    with pytest.raises(ConfigError, match="llama3_8b.py is not valid Python"):
        read_job(bad, gpus=64)
    assert main(["estimate", "--from", str(DATA / "llama3_8b.py"), "--gpus", "64"]) == 0
    assert "torchtitan Python config, read with ast" in capsys.readouterr().out


def test_megatrons_default_layernorm_on_a_llama_trains_like_one_process(lab, tmp_path):
    """Megatron's Llama 3 8B script without --normalization (its 157006d6 form: LayerNorm, a bias beside
    every norm's weight, on SwiGLU and rope), shrunk to the session's engines, and the same model under
    TP + SP (the norms' biases replicated over tp, their gradients summed over SP's rows): each exact
    against one process, the theory's count the engines'."""
    from labkit import ParallelConfig, reference
    from labkit.config.jobs.shrink import shrink
    from labkit.oracle.checks import mismatches

    script = tmp_path / "train_llama3_8b_h100_fp8.sh"
    script.write_text((DATA / "megatron_llama3_8b_fp8.sh").read_text().replace("    --normalization RMSNorm\n", ""))
    job = read_job(script, script_args=["/ckpt", "/tb"])
    small = shrink(job, engines=lab.world)
    assert small.model.norms.bias and not small.model.norms.rms
    for cfg in (small.parallel, ParallelConfig(tp=2, dp=2, sequence_parallel=True, precision="bf16")):
        res = lab.run(cfg, model=small.model, steps=2, return_params=True)
        assert sum(v.size for v in res.params.values()) == small.model.num_params()
        found = mismatches(res, reference(small.model, steps=2, global_batch=cfg.global_batch))
        assert found == [], (cfg, [str(f) for f in found])
