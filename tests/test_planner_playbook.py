"""The Ultra-Scale Playbook's 26 best configurations (labkit/theory/planner/playbook.py): transcribed
as nanotron ran them, counted as nanotron counts MFU, and the blind prediction kept in
benchmarks/RESULTS.md (never replaced by a later run)."""

from __future__ import annotations

import os

from labkit import theory
from labkit.theory.planner.ops import model_flops_per_token
from labkit.theory.planner.playbook import MODELS, PEAK, PLAYBOOK, model, nanotron_flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_26_cells_as_the_figure_gives_them():
    assert len(PLAYBOOK) == 26
    nodes = [int(r.name.split(", ")[1].split()[0]) for r in PLAYBOOK]
    assert sorted(set(nodes)) == [1, 2, 4, 8, 16, 32, 64]
    for run in PLAYBOOK:
        c = run.config
        # the world is the nodes' GPUs, the batch about 1M tokens (0.5M to 1M: the sweep's GBS)
        assert c.world == 8 * int(run.name.split(", ")[1].split()[0]), run.name
        assert 2**19 <= c.global_batch * run.model["seq"] <= 2**20, run.name
        assert c.sequence_parallel == (c.tp > 1) and not c.recomputation.recomputes and c.cp == 1
        assert 0 < run.mfu < 0.5 and 8 < run.memory_gib < 67


def test_the_models_have_the_figures_parameter_counts():
    for name, (*_, billions) in MODELS.items():
        assert round(theory.num_params(theory.ModelConfig(**model(name))) / 1e9, 2) == billions, name


def test_nanotron_counts_the_flops_as_palm_does_for_these_models():
    """nanotron's get_flops (the attention square whole, the LM head) is 6N + 12·L·h·s here but for the
    norms' weights, which PaLM's N holds and nanotron leaves out (4e-5 of the count), so an error in
    MFU is the same error in tokens/s/GPU; and the published tokens/s inverts the MFU."""
    for name in MODELS:
        m = model(name)
        ours = model_flops_per_token(theory.ModelConfig(**m))
        norms = 6 * (2 * m["layers"] + 1) * m["hidden"]
        assert nanotron_flops_per_token(m) == ours - norms, name
    run = PLAYBOOK[0]
    assert abs(run.tokens_per_second_per_gpu * nanotron_flops_per_token(run.model) / PEAK - run.mfu) < 1e-12
    # the count can tell GQA apart: with fewer kv heads nanotron's qkv products shrink
    gqa = dict(model("8.86B"), kv_heads=8)
    assert nanotron_flops_per_token(gqa) < nanotron_flops_per_token(model("8.86B"))


def test_every_playbook_layout_passes_the_validation_and_fits():
    for run in PLAYBOOK:
        p = theory.evaluate(run.config, run.model_config, "h100", stack=run.stack)
        assert p.fits and 0 < p.mfu <= 1, run.name


def test_the_blind_prediction_is_kept_in_results():
    """benchmarks/RESULTS.md holds the first prediction, dated with its commit, written once."""
    text = open(os.path.join(ROOT, "benchmarks", "RESULTS.md")).read()
    begin, end = "<!-- playbook.py blind begin -->", "<!-- playbook.py blind end -->"
    assert begin in text and end in text
    block = text[text.index(begin) : text.index(end)]
    assert "commit " in block and block.count("| Playbook") + block.count("nodes,") >= 26


RANKED = 6
"""The Playbook's layouts the planner finds (its top 5 over the sweep's space, or within 10% of its
best) as of 146af6a; the issue asks for 20 of 26. A change that finds fewer fails here."""


def test_the_planner_finds_the_playbooks_layouts_no_less_often():
    from labkit.theory.planner.playbook import found, sweep_plans

    hits = []
    for run in PLAYBOOK:
        priced = theory.evaluate(run.config, run.model_config, "h100", stack=run.stack)
        hits.append(found(run, priced, sweep_plans(run)))
    assert sum(hits) >= RANKED, sum(hits)


def test_the_ranking_check_can_fail():
    """A layout absent from the list and predicted at half the best's speed is not found; present, it is."""
    from labkit.theory.planner.playbook import found, sweep_plans

    run = PLAYBOOK[-1]
    plans = sweep_plans(run)
    slow = type("P", (), {"tokens_per_second_per_gpu": plans[0].tokens_per_second_per_gpu / 2})()
    others = [p for p in plans if p.config.pp != run.config.pp or p.config.dp != run.config.dp]
    assert not found(run, slow, others)
    same = theory.evaluate(run.config, run.model_config, "h100", stack=run.stack)
    assert found(run, same, [same] + others)
