"""The planner where people meet it (no cluster): `labkit plan` prints the best layouts with every
memory term of the first, and the ScaleExplorer shows every term, lists the best layouts and opens
one on a click (widget logic, no browser)."""

from __future__ import annotations

from labkit.cli import main
from labkit.theory.planner.gpu_memory import TERMS
from labkit.widgets import ScaleExplorer


def test_labkit_plan_prints_the_table_and_every_memory_term(capsys):
    assert main(["plan", "--model", "llama-7b", "--gpus", "64", "--global-batch", "128", "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:2].strip() in ("1", "2", "3")]
    assert len(rows) == 3 and all("tokens/s/GPU" not in r and " · " in r for r in rows)
    memory = out.split("memory of #1", 1)[1]
    for term in TERMS:
        assert f"{term} " in memory, term
    assert "time of #1" in out and "layouts priced" in out


def test_labkit_plan_as_the_issue_writes_it(capsys):
    assert main(["plan", "--model", "llama-3.1-70b", "--gpus", "256", "--hardware", "h100", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "llama-3.1-70b: Ψ = 70,553,706,496 parameters on 256 x H100" in out and "rejected:" in out


def test_labkit_plan_refuses_what_it_cannot_plan(capsys):
    assert main(["plan", "--model", "llama-71b", "--gpus", "8"]) == 2
    assert "llama-70b" in capsys.readouterr().err


def test_labkit_plan_holds_what_it_is_told_to(capsys):
    args = ["plan", "--model", "llama-7b", "--gpus", "64", "--global-batch", "128", "--top", "3"]
    assert main([*args, "--fix", "tp=8", "--fix", "sharding=fsdp", "--fix", "sequence_parallel=true"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:2].strip() in ("1", "2", "3")]
    assert len(rows) == 3 and all("fsdp" in r and "tp 8" in r and "SP" in r for r in rows), rows
    assert main([*args, "--fix", "tp"]) == 2
    assert "write FIELD=VALUE" in capsys.readouterr().err


def test_scale_explorer_shows_every_term_and_opens_a_plan_on_a_click():
    x = ScaleExplorer(model="llama-7b", gpus=64, tp=8)
    gpu = x.figures["gpu"]
    assert [t.name for t in gpu.data] == list(TERMS)
    assert "tokens/s/GPU" in gpu.layout.title.text and "tokens/s/GPU" in x.status.value
    x.plans.search()
    assert 0 < len(x.plans.buttons) <= 5 and "layouts priced" in x.plans.note.value
    best = x.plans.plans[0]
    x.plans.buttons[0].click()
    x.wait()
    assert x.error_box.value == ""
    assert x.view.config == best.config
    assert x.view.plan.tokens_per_second_per_gpu == best.tokens_per_second_per_gpu
    x.controls["checkpoint_activations"].value = "selective"  # the recompute control, by mode
    assert x.view.config.recompute == "selective"


def test_scale_explorer_shows_what_the_fused_loss_saves():
    x = ScaleExplorer(model="llama3.1-8b", gpus=8)
    x.controls["precision"].value = "bf16"
    logits = {t.name: t.y[0] for t in x.figures["gpu"].data}["logits"]
    x.controls["loss"].value = "fused"
    assert x.model.loss == "fused"
    fused = {t.name: t.y[0] for t in x.figures["gpu"].data}["logits"]
    assert 0 < fused < logits / 3  # 2 bytes a logit and one fp32 chunk, against 8 bytes a logit
