"""Megatron-LM's own example launch scripts, verbatim (tests/data/jobs/README.md: source and commit),
read as bash would read them (labkit/config/jobs/shell/) to their published parameter counts and
layouts; broken copies refused by name; no command of a script ever run; the stack each names,
priced for the job's layout and the planner's alternatives alike."""

from __future__ import annotations

import pathlib

import pytest

from labkit import ConfigError, theory
from labkit.cli import main
from labkit.config.jobs import read_job
from labkit.theory.presets import DEEPSEEK_V3, LLAMA31_8B, MIXTRAL_8X7B, PUBLISHED_PARAMS

DATA = pathlib.Path(__file__).parent / "data" / "jobs"
MIXTRAL, DSV3, LLAMA8, LLAMA8_FSDP, GPT3 = (
    DATA / f
    for f in (
        "megatron_mixtral_8x7b.sh",
        "megatron_deepseek_v3.sh",
        "megatron_llama3_8b_fp8.sh",
        "megatron_llama3_8b_fsdp_fp8.sh",
        "megatron_gpt3_175b.sh",
    )
)
MIXTRAL_AT = {"vocab": 32000, "env": {"SLURM_NNODES": "4"}}
"""Mixtral's Llama 2 tokenizer (32,000 tokens; labkit reads no tokenizer) on 4 nodes: the README's TP1 EP8 PP4
needs 32 GPUs (Megatron's expert data-parallel size, world / (PP x EP x expert TP), is whole from 32 on)."""
DSV3_AT = {"vocab": 129280, "gpus": 256}
"""DeepSeek-V3's tokenizer (129,280 tokens, its config.json's vocab_size) on 256 GPUs: the script's #SBATCH
--nodes is a placeholder (your_own_num_nodes), the world is the caller's."""


def broken(tmp_path, src: pathlib.Path, old: str, new: str) -> pathlib.Path:
    text = src.read_text()
    assert old in text, old
    out = tmp_path / src.name
    out.write_text(text.replace(old, new))
    return out


def test_mixtral_reads_to_its_published_model_and_the_readme_s_layout():
    job = read_job(MIXTRAL, **MIXTRAL_AT)
    p, m = job.parallel, job.model
    assert (p.world, p.tp, p.pp, p.ep, p.dp, job.gpus_per_node) == (32, 1, 4, 8, 1, 8)  # "TP1EP8PP4"
    assert (p.sharding, p.global_batch, p.microbatches, p.precision, p.sequence_parallel) == (
        "zero1",
        256,
        32,
        "bf16",
        False,
    )
    assert m.num_params() == PUBLISHED_PARAMS["mixtral-8x7b"]
    assert m.replace(seq=MIXTRAL_8X7B.seq, vocab_divisible_by=None) == MIXTRAL_8X7B  # the script trains at 4096
    assert (job.stack, "Transformer Engine" in job.stack_reason) == ("te", True)
    # run bare, as its README's docker line does on one node: Megatron refuses that world too
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 8 does not divide the data-parallel size 2"):
        read_job(MIXTRAL, vocab=32000)


def test_deepseek_v3_reads_mla_shared_experts_and_the_layer_pattern():
    job = read_job(DSV3, **DSV3_AT)
    p, m = job.parallel, job.model
    assert m.num_params() == PUBLISHED_PARAMS["deepseek-v3"] == 671_026_404_352
    # the README's "TP=1, EP=8, CP=1, FSDP ZeRO-3", MBS 4, GBS 2048, BF16, selective recomputation
    assert (p.tp, p.ep, p.cp, p.dp, p.sharding, p.global_batch, p.microbatches) == (1, 8, 1, 32, "zero3", 2048, 2)
    assert (p.precision, p.recompute) == ("bf16", "selective")
    same = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "yarn", "experts")
    same += ("top_k", "moe_ffn", "shared_experts", "router", "n_group", "topk_group", "routed_scaling_factor")
    assert all(getattr(m, k) == getattr(DEEPSEEK_V3, k) for k in same + ("dense_layers", "ffn", "layers"))
    assert (m.bias_update_speed, m.aux_loss_coef) == (1e-3, 1e-4)  # --moe-router-bias-update-rate, --moe-aux-loss-coeff
    notes = " ".join(job.notes)
    assert "the launch is the value of TRAINING_CMD" in notes and "--mtp-num-layers 1" in notes


def test_the_two_llama3_8b_scripts_read_with_their_positional_arguments_and_environment():
    # as the README runs it: the checkpoint and TensorBoard paths, mock data
    job = read_job(LLAMA8, script_args=["/workspace/checkpoints", "/workspace/tensorboard_logs"])
    p = job.parallel
    assert job.model.replace(vocab_divisible_by=None, rope_theta=LLAMA31_8B.rope_theta, rope_scaling=None) == (
        LLAMA31_8B.replace(rope_scaling=None)
    )  # the script's rotary base is 1e6, no Llama 3.1 scaling: the same 8,030,261,248 parameters
    assert job.model.num_params() == PUBLISHED_PARAMS["llama3.1-8b"]
    assert (p.world, p.dp, p.sharding, p.precision, p.global_batch, p.microbatches) == (8, 8, "zero1", "fp8", 128, 16)
    notes = " ".join(job.notes)
    assert "--save /workspace/checkpoints" in notes and "--mock-data" in notes and "line 180" in notes
    # the real-data branch of its `if [[ ... ]]`, taken by the third and fourth arguments
    real = read_job(LLAMA8, script_args=["c", "t", "/tok.model", "/data/prefix"])
    assert "--data-path /data/prefix" in " ".join(real.notes) and real.model == job.model
    # Megatron-FSDP: ZeRO-3 by default, the distributed optimizer with USE_MEGATRON_FSDP=0
    fsdp = read_job(LLAMA8_FSDP)
    assert (fsdp.parallel.sharding, fsdp.parallel.world, fsdp.model.num_params()) == ("zero3", 8, 8_030_261_248)
    assert read_job(LLAMA8_FSDP, env={"USE_MEGATRON_FSDP": "0"}).parallel.sharding == "zero1"


def test_gpt3_175b_as_written_contradicts_its_own_degrees():
    """NUM_NODES=1 is written in the script, not read from the environment: 8 GPUs for TP 8 x PP 16."""
    with pytest.raises(ConfigError, match=r"world 8 GPUs is not divisible by --tensor-model-parallel-size 8 x "):
        read_job(GPT3, vocab=50257)


def test_a_refused_script_names_every_problem_at_once():
    """The GPT-3 script as published, read bare: its tokenizer files without a vocabulary size (and what
    GPT-2's BPE would be, padded as Megatron pads it) and its world against its degrees, in one error."""
    with pytest.raises(ConfigError) as err:
        read_job(GPT3)
    said = err.value.problems
    assert len(said) == 2, said
    assert "names a tokenizer (--vocab-file, --merge-file) but no --vocab-size" in said[0]
    assert "GPT-2's BPE has 50,257 entries" in said[0] and "1,024: 51,200 rows" in said[0]
    assert said[1].startswith("world 8 GPUs is not divisible by") and "give 128 GPUs" in said[1]


def test_three_problems_of_one_file_are_named_together(tmp_path):
    """A copy of the Llama 3 8B script with three things wrong: no micro batch, SwiGLU with learned
    positions, and an expert TP apart from TP. One error, three problems, each with its fix."""
    text = LLAMA8.read_text().replace("--micro-batch-size $MICRO_BATCH_SIZE", "")
    text = text.replace("--position-embedding-type rope", "--position-embedding-type learned_absolute")
    text = text.replace("--swiglu\n", "--swiglu\n    --expert-tensor-parallel-size 2\n")
    path = tmp_path / "three.sh"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_job(path, script_args=["/ckpt", "/tb"])
    said = " | ".join(err.value.problems)
    assert len(err.value.problems) == 3, said
    assert "--swiglu on with --position-embedding-type learned_absolute" in said
    assert "--expert-tensor-parallel-size 2 differs" in said and "no --micro-batch-size" in said


def test_the_llama3_8b_script_without_normalization_is_megatrons_default_layernorm(tmp_path):
    """Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh at 157006d6 passes --swiglu, rope and
    --apply-layernorm-1p but no --normalization (its MODEL_ARGS are the d98e8a64 copy's above less that one
    line, compared with the search tool): Megatron builds its default LayerNorm, a bias beside each weight,
    65 norms x 4,096 more parameters than the RMSNorm model: 8,030,527,488."""
    old = tmp_path / "train_llama3_8b_h100_fp8.sh"
    old.write_text(LLAMA8.read_text().replace("    --normalization RMSNorm\n", ""))
    job = read_job(old, script_args=["/ckpt", "/tb"])
    assert (job.model.arch, job.model.norm, job.model.norms.bias) == ("llama", "layernorm", True)
    assert job.model.num_params() == 8_030_261_248 + 65 * 4_096 == 8_030_527_488
    assert theory.num_params(job.model) == job.model.num_params()


@pytest.mark.parametrize(
    "src, old, new, at, error",
    [
        (
            MIXTRAL,
            "    --overlap-grad-reduce\n)\n",
            "    --overlap-grad-reduce\n\n",
            MIXTRAL_AT,
            r"line 50: MOE_ARGS=\( \.\.\. \) is not closed by '\)'",  # MOE_ARGS=( opens on line 50
        ),  # fmt: skip
        (MIXTRAL, "    --disable-bias-linear\n", "", MIXTRAL_AT, "without --disable-bias-linear"),
        (DSV3, "    --qk-layernorm\n", "", DSV3_AT, "--multi-latent-attention without --qk-layernorm"),
        (DSV3, "[0]*3+[1]*58", "[0]*3+[1]*57", DSV3_AT, r"must give 0 or 1 for each of --num-layers 61 layers"),
        (DSV3, "[0]*3+[1]*58", "[1]*58+[0]*3", DSV3_AT, "labkit builds dense layers first"),
        (
            DSV3,
            "--moe-shared-expert-intermediate-size 2048",
            "--moe-shared-expert-intermediate-size 3000",
            DSV3_AT,
            "is not a multiple of the experts' width 2048",
        ),  # fmt: skip
        (
            LLAMA8,
            "GLOBAL_BATCH_SIZE=128",
            "GLOBAL_BATCH_SIZE=100",
            {},
            r"--global-batch-size 100 is not divisible by --micro-batch-size 1 x the data-parallel size 8",
        ),  # fmt: skip
        (
            LLAMA8_FSDP,
            'SHARDING_STRATEGY:-"optim_grads_params"',
            'SHARDING_STRATEGY:-"optim_grads_param"',
            {},
            "--data-parallel-sharding-strategy optim_grads_param is not one of",
        ),  # fmt: skip
        (
            LLAMA8_FSDP,
            "WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))",
            "WORLD_SIZE=$(nvidia-smi -L | wc -l)\nNP=$WORLD_SIZE",
            {},
            None,
        ),  # fmt: skip
    ],
    ids=[
        "mixtral-array",
        "mixtral-biases",
        "dsv3-latent-norms",
        "dsv3-pattern-length",
        "dsv3-pattern-order",
        "dsv3-shared",
        "llama8-batch",
        "llama8-fsdp-strategy",
        "llama8-fsdp-unused-substitution",
    ],  # fmt: skip
)
def test_broken_copies_are_refused_by_name(tmp_path, src, old, new, at, error):
    bad = broken(tmp_path, src, old, new)
    if error is None:  # a command substitution no launch word uses: read past, as bash would leave it unused
        assert read_job(bad, **at).world == 8
        return
    with pytest.raises(ConfigError, match=error):
        read_job(bad, **at)


def test_no_command_of_a_script_is_ever_run(tmp_path):
    """rm and touch planted at the top, inside an if, in a command substitution and in backticks: the
    reader reads past them all, and the file they name is still there and the other never made."""
    victim, made = tmp_path / "victim.txt", tmp_path / "made.txt"
    victim.write_text("still here")
    planted = (
        f"rm -f {victim}\ntouch {made}\nX=$(rm -f {victim}; touch {made})\nY=`touch {made}`\n"
        f'if [ "$DTYPE" = "" ]; then rm -f {victim}; touch {made}; fi\n'
    )
    script = tmp_path / "planted.sh"
    script.write_text(planted + MIXTRAL.read_text() + f"\nrm -f {victim}\n")
    job = read_job(script, **MIXTRAL_AT)
    assert job.model.num_params() == PUBLISHED_PARAMS["mixtral-8x7b"]
    assert victim.read_text() == "still here" and not made.exists()
    # a substitution the launch would use is refused, and still not run
    used = tmp_path / "used.sh"
    used.write_text(MIXTRAL.read_text().replace("GPUS_PER_NODE=8", f"GPUS_PER_NODE=$(touch {made}; echo 8)"))
    with pytest.raises(ConfigError, match=r"line 13: \$\(\( \$GPUS_PER_NODE\*\$NNODES \)\) uses the output of `touch"):
        read_job(used, **MIXTRAL_AT)
    assert not made.exists()


def test_plan_from_a_megatron_job_prices_the_fused_stack_and_says_so(capsys):
    args = ["--from", str(MIXTRAL), "--vocab", "32000", "--env", "SLURM_NNODES=4", "--top", "2"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "stack: te (transformer_engine, core_v0.14.0's default: Transformer Engine's fused kernels" in out
    assert "the te stack (Megatron-Core's Transformer Engine kernels) priced at the compile stack's" in out
    assert "your job's layout (te stack, as the alternatives)" in out
    assert main(["plan", *args, "--stack", "eager"]) == 0  # overridable: eager for the job and the alternatives
    out = capsys.readouterr().out
    assert "stack given: eager (--stack), in place of the job's te" in out and "(eager stack, as the" in out
    assert main(["estimate", "--from", str(DSV3), "--vocab", "129280", "--gpus", "256"]) == 0
    assert "stack: te" in capsys.readouterr().out


def test_the_fused_stack_is_the_compiled_pace_and_less_pessimistic_than_eager():
    job = read_job(MIXTRAL, **MIXTRAL_AT)
    t = {s: theory.evaluate(job.parallel, job.model, "h100", stack=s) for s in ("eager", "compile", "te")}
    assert t["te"].step_seconds == t["compile"].step_seconds < t["eager"].step_seconds
    assert t["te"].stack == "te" and any("not measured on a GPU yet" in a for a in t["te"].hw.assumptions)
