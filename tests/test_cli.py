"""The command line: the default demo writes a report with every figure; estimate prints a table."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from labkit.cli import main


def test_estimate_prints_the_table(capsys):
    assert main(["estimate", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "all_reduce" in out and "bubble 0.000" in out


def test_estimate_refuses_a_bad_layout(capsys):
    assert main(["estimate", "--tp", "3"]) == 2
    assert "heads=4 is not divisible by tp=3" in capsys.readouterr().err


def test_default_run_writes_a_report(tmp_path):
    report = tmp_path / "report.html"
    out = subprocess.run(
        [sys.executable, "-m", "labkit.cli", "run", "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "steps [########################] 3/3" in out.stderr  # the CLI's text bar, rewritten in place
    html = report.read_text()
    # every figure of widgets/figures.py RUN_FIGURES that a run without a pipeline has, each once
    assert len(re.findall(r'class="plotly-graph-div"', html)) == 5
    for name in ("memory", "comm", "timeline", "traffic", "loss"):
        assert f'<section id="{name}">' in html


def test_estimate_of_a_preset_says_what_dominates(capsys):
    from labkit.theory import num_params
    from labkit.theory.presets import LLAMA_70B

    assert (
        main(
            [
                "estimate",
                "--model",
                "llama-70b",
                "--dp",
                "32",
                "--tp",
                "8",
                "--pp",
                "4",
                "--microbatches",
                "16",
                "--global-batch",
                "512",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"Ψ = {num_params(LLAMA_70B):,} parameters; 1,024 ranks" in out
    assert "tp all_reduce" in out and "dominated by" in out


def test_estimate_refuses_an_unknown_preset(capsys):
    assert main(["estimate", "--model", "llama-71b"]) == 2
    assert "llama-70b" in capsys.readouterr().err


def test_a_run_that_does_not_match_exits_non_zero_saying_why(monkeypatch, capsys):
    """The run checked against the real reference of another seed (a wrong oracle, no mock): the
    command exits 1 and names the checks that failed."""
    import labkit.cli as cli

    real = cli.reference
    monkeypatch.setattr(cli, "reference", lambda model, **kw: real(model, **{**kw, "seed": kw["seed"] + 1}))
    tiny = ["--model-layers", "2", "--model-hidden", "32", "--model-ffn", "128", "--model-vocab", "128"]
    assert main(["run", "--steps", "2", "--model-seq", "16", *tiny]) == 1
    err = capsys.readouterr().err
    assert "the run does not train like the one-process reference" in err
    assert "[gradients]" in err and "[losses] the loss differs from the reference's beyond 1e-05 at step 0" in err


def test_torchrun_runs_a_script_and_writes_its_report(tmp_path):
    scripts = pathlib.Path(__file__).parent / "data" / "scripts"
    report = tmp_path / "report.html"
    cli = [sys.executable, "-m", "labkit.cli", "torchrun", "--engines", "2"]
    out = subprocess.run(
        [*cli, "--report", str(report), str(scripts / "tp_mlp.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "[rank0]:step 1 loss" in out.stdout and "rank 1: exit 0, 2 steps" in out.stdout
    assert re.search(r"rank 0 +tp all_reduce +4 calls", out.stdout), out.stdout
    html = report.read_text()
    assert "torchrun --nnodes=1 --nproc-per-node=2" in html
    for name in ("memory", "comm", "timeline", "traffic"):
        assert f'<section id="{name}">' in html
    failed = subprocess.run(
        [*cli, str(scripts / "contract.py"), str(tmp_path), "--exit", "3"], capture_output=True, text=True, timeout=300
    )
    said = failed.stderr[-4000:]
    assert failed.returncode == 1 and "contract.py FAILED" in failed.stderr and "exitcode  : 3" in failed.stderr, said
