"""torchtitan's registry read into labkit (labkit/config/jobs/torchtitan/flavors.py): every family labkit
builds, every flavor, each the parameter count of torchtitan's own model built on the meta device
(where torchtitan is installed: the extra; CI sets LABKIT_REQUIRE_TORCHTITAN=1 so that it runs there),
and the TOML fields that choose them, compile among them. torchtitan's own code on the Lab's engines is
notebook 14's last section (engines/titan.py), executed by tests/test_notebooks.py; its verdict, with a
must-fail control (a gradient halved after backward) in bf16 and fp32, is held here."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib

import pytest

from labkit import ConfigError
from labkit.cli import main
from labkit.config.jobs import read_job
from labkit.config.jobs.torchtitan.flavors import FAMILIES, NOT_BUILT, flavor_model
from labkit.theory.presets import PUBLISHED_PARAMS

DATA = pathlib.Path(__file__).parent / "data" / "jobs"
HAVE = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(
    not HAVE and not os.environ.get("LABKIT_REQUIRE_TORCHTITAN"),
    reason="torchtitan is not installed: pip install --no-deps torchtitan==0.3.0 && pip install -e .[torchtitan]",
)
REGISTRY = {"llama3": "llama3_configs", "qwen3": "qwen3_configs", "deepseek_v3": "deepseekv3_configs",
            "gpt_oss": "gptoss_configs"}  # fmt: skip
"""Each family's flavor dict in torchtitan/models/<name>/__init__.py."""


@needs_torchtitan
def test_every_flavor_has_torchtitan_s_own_parameter_count():
    import torch
    from torchtitan import __version__

    assert __version__ == "0.3.0"  # the release the flavors were transcribed from
    for name, (table, _) in FAMILIES.items():
        module = importlib.import_module(f"torchtitan.models.{name}")
        assert list(getattr(module, REGISTRY[name])) == list(table), name  # every flavor, none invented
        for flavor in table:
            with torch.device("meta"):  # shapes only: 671B parameters in no memory
                theirs = module.model_registry(flavor).model.build()
            count = sum(p.numel() for p in theirs.parameters())
            assert flavor_model(name, flavor, 4096)[0].num_params() == count, (name, flavor)


def test_the_flavors_of_published_models_are_their_published_counts():
    same = {
        ("llama3", "1B"): "llama3.2-1b",
        ("llama3", "8B"): "llama3.1-8b",
        ("llama3", "70B"): "llama3.1-70b",
        ("llama3", "405B"): "llama-405b",
        ("qwen3", "8B"): "qwen3-8b",
        ("qwen3", "30B-A3B"): "qwen3-30b-a3b",
        ("deepseek_v3", "671B"): "deepseek-v3",
        ("gpt_oss", "20b"): "gpt-oss-20b",
        ("gpt_oss", "120b"): "gpt-oss-120b",
    }
    for (name, flavor), published in same.items():
        assert flavor_model(name, flavor, 4096)[0].num_params() == PUBLISHED_PARAMS[published], (name, flavor)


def toml(tmp_path, body: str) -> pathlib.Path:
    path = tmp_path / "job.toml"
    path.write_text(body)
    return path


def test_a_toml_names_any_family_and_its_layout_reads(tmp_path):
    moe = toml(tmp_path, '[model]\nname = "qwen3"\nflavor = "30B-A3B"\n[parallelism]\nexpert_parallel_degree = 8\n'
                         "[training]\nseq_len = 4096\nlocal_batch_size = 2\n")  # fmt: skip
    job = read_job(moe, gpus=64)
    p = job.parallel
    assert job.model.num_params() == PUBLISHED_PARAMS["qwen3-30b-a3b"]
    assert (p.dp, p.ep, p.sharding, p.global_batch) == (8, 8, "fsdp", 128)  # 64 data ranks, 8 of them experts each
    assert any("expert_parallel_degree = 8" in n for n in job.notes)
    dsv3 = read_job(toml(tmp_path, '[model]\nname = "deepseek_v3"\nflavor = "671B"\n'), gpus=256)
    assert dsv3.model.num_params() == PUBLISHED_PARAMS["deepseek-v3"] and dsv3.model.router == "sigmoid"
    debug = read_job(DATA / "llama3_debug_model.toml", gpus=4)
    assert (debug.model.num_params(), debug.model.vocab, debug.parallel.dp) == (6_163_712, 2048, 4)


@pytest.mark.parametrize(
    "body, error",
    [
        ('[model]\nname = "qwen3_5"\nflavor = "9B"\n', "qwen3_5.*Gated DeltaNet linear-attention layers are not built"),
        ('[model]\nname = "qwen3"\nflavor = "7B"\n', r"flavor = '7B': torchtitan 0.3.0 has \['debugmodel'"),
        ('[model]\nname = "mamba"\n', r"'mamba' is not a torchtitan model labkit reads"),
        ('[model]\nflavor = "8B"\n[parallelism]\nexpert_parallel_degree = 2\n', "which has no experts; set it to 1"),
        (
            '[model]\nname = "gpt_oss"\nflavor = "20b"\n[parallelism]\nexpert_parallel_degree = 3\n',
            "ep must divide data_parallel_shard_degree",
        ),  # fmt: skip
    ],
)
def test_what_the_registry_does_not_hold_is_refused_by_name(tmp_path, body, error):
    with pytest.raises(ConfigError, match=error):
        read_job(toml(tmp_path, body), gpus=8)
    assert set(NOT_BUILT) == {"qwen3_5", "kimi_k2_7", "flux", "muse_glimmer"}  # torchtitan 0.3.0's other families


def test_compile_is_read_into_the_layout_and_its_stack(tmp_path, capsys):
    old = read_job(toml(tmp_path, '[model]\nflavor = "8B"\n[training]\ncompile = true\n'), gpus=8)
    new = read_job(toml(tmp_path, '[model]\nflavor = "8B"\n[compile]\nenable = true\ncomponents = ["model"]\n'), gpus=8)
    loss = read_job(toml(tmp_path, '[model]\nflavor = "8B"\n[compile]\nenable = true\ncomponents = ["loss"]\n'), gpus=8)
    assert (old.parallel.compile, old.stack) == (new.parallel.compile, new.stack) == (True, "compile")
    assert (loss.parallel.compile, loss.stack) == (False, "eager") and "loss alone" in loss.stack_reason
    assert not any("compile" in n for n in old.notes + new.notes)  # read, not listed as unused
    path = toml(tmp_path, '[model]\nflavor = "8B"\n[training]\ncompile = true\nseq_len = 8192\n')
    assert main(["plan", "--from", str(path), "--gpus", "64", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "stack: compile ([training] compile = true" in out and "(compile stack, as the alternatives)" in out


def halved_after_backward(model, data, ctx):
    """torchtitan's rank step (engines/titan.py), then every gradient halved: divided by 2 once too often."""
    from labkit.engines import titan

    out = titan.step(model, data, ctx)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(2)
    return out


@needs_torchtitan
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_torchtitans_own_fsdp_tp_verifies_and_its_halved_gradient_fails(lab, tmp_path, precision):
    """torchtitan's debug model under its own parallelize_llama at FSDP x TP + SP (notebook 14's job), verified
    against one process in bf16 (its bounds counted on the ranks' own step) and in fp32 (1e-5); the same step
    with every gradient halved after backward must fail in both, named."""
    import functools

    from labkit.engines import titan

    path = tmp_path / "debug_model.toml"
    toml = (DATA / "llama3_debug_model.toml").read_text()
    path.write_text(toml.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 2"))
    job = read_job(path, gpus=4, seq=64)
    p, m = job.parallel.replace(precision=precision), job.model

    def verify(step):
        return lab.verify(
            functools.partial(titan.build, "debugmodel", m.seq, p.sequence_parallel),
            functools.partial(titan.parallelize, cfg=p.to_dict()),
            mesh={"dp_shard": p.dp, "tp": p.tp},
            batch=functools.partial(titan.batch, rows=p.global_batch, seq=m.seq, vocab=m.vocab),
            loss=titan.loss,
            step=step,
            precision=precision,
            timeout=600,
        )

    verify(titan.step).assert_ok()
    report = verify(halved_after_backward)
    assert not report.ok and report.first().check == "gradients", report.summary()
    if precision == "fp32":  # one factor on every tensor, found and named
        assert report.factor == pytest.approx(0.5, rel=1e-4), report.summary()
