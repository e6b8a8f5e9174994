"""The figures of the planner's answers (widgets/planner_figures.py, widgets/context_figure.py) and the
style they share: what each draws is the number it came from (Plan.links(), theory.evaluate,
theory.plan, the mesh's groups), read back from the figure's data. No cluster."""

from __future__ import annotations

import pytest
from test_figures import test_a_figure_a_person_can_read as readable

from labkit import ParallelConfig, theory
from labkit.layout.mesh import MeshLayout
from labkit.theory.presets import PRESETS
from labkit.widgets import ScaleExplorer, figures
from labkit.widgets.context_figure import best_kinds, context_at_scale
from labkit.widgets.planner_figures import LINKS, group_crossings
from labkit.widgets.style import INK, PAPER, dim_color, rank_color

LLAMA_70B = PRESETS["llama3.1-70b"]
LLAMA_8B = PRESETS["llama3.1-8b"]
FSDP = ParallelConfig(dp=512, sharding="fsdp", global_batch=512, precision="bf16", checkpoint_activations=True)


def house_style(name: str, fig) -> None:
    """test_figures' readability checks, and the paper and ink every figure carries (below)."""
    readable(name, fig)
    assert fig.layout.paper_bgcolor == PAPER and fig.layout.plot_bgcolor == PAPER, name
    assert fig.layout.font.color == INK, name


def bar(fig, name):
    return next(t for t in fig.data if t.name == name)


def at(trace, candidate: str, link: str) -> float:
    """The value a horizontal bar trace draws at the two-level category (candidate, link)."""
    return trace.x[list(zip(trace.y[0], trace.y[1])).index((candidate, link))]


def test_links_draw_what_each_plan_sends_inside_a_node_and_across():
    """HSDP beside flat FSDP (test_planner_links.py's case): each bar is its Plan.links() row."""
    plans = {
        "flat FSDP": theory.evaluate(FSDP, LLAMA_70B),
        "HSDP": theory.evaluate(FSDP.replace(dp_replicate=64), LLAMA_70B),
    }
    fig = figures.links_figure(plans)
    house_style("links", fig)
    for name, plan in plans.items():
        for row in plan.links():
            if row["dim"] == "total":
                continue
            drawn = bar(fig, row["dim"])
            assert at(drawn, name, LINKS[0]) == row["GB over NVLink"]
            assert at(drawn, name, LINKS[1]) == row["GB across nodes"]
            assert drawn.marker.color == dim_color(row["dim"])
    # the stacks add up to the plan's totals, and the title names the one that sends least across
    for name, plan in plans.items():
        total = next(r for r in plan.links() if r["dim"] == "total")
        across = sum(at(t, name, LINKS[1]) for t in fig.data)
        assert across == pytest.approx(total["GB across nodes"])
    assert "least across nodes: HSDP" in fig.layout.title.text
    assert bar(fig, "dp_replicate").marker.color != bar(fig, "dp_shard").marker.color != bar(fig, "dp").marker.color


def test_alternatives_rank_the_jobs_own_layout_among_the_plans():
    plans = theory.plan(LLAMA_8B, 64, "h100", top=4)
    own = theory.evaluate(FSDP.replace(dp=64, global_batch=64), LLAMA_8B, "h100")
    fig = figures.alternatives_figure(plans, own, "flat FSDP")
    house_style("alternatives", fig)
    place = 1 + sum(p.tokens_per_second_per_gpu > own.tokens_per_second_per_gpu for p in plans)
    mine = bar(fig, "flat FSDP")
    assert list(mine.x) == [own.tokens_per_second_per_gpu]
    assert mine.y[0].replace("<br>", " · ").startswith(f"#{place} ▶ flat FSDP: {own.layout()}")
    assert list(bar(fig, "the planner's alternatives").x) == [p.tokens_per_second_per_gpu for p in plans]
    assert f"ranks #{place} of {len(plans) + 1}" in fig.layout.title.text
    # the y axis lists every entry best first
    order = list(fig.layout.yaxis.categoryarray)
    assert [int(label.split()[0][1:]) for label in order] == list(range(1, len(plans) + 2))


def test_group_crossings_count_each_dims_groups_that_span_nodes():
    """Megatron's Llama 3.1 405B layout on 1,024 GPUs, 8 a node (notebook 14): tp stays in a node."""
    cfg = ParallelConfig(dp=8, tp=8, pp=8, cp=2, order="tp-cp-ep-dp-pp", microbatches=8, global_batch=64)
    layout = MeshLayout.of(cfg)
    hosts = [f"node{r // 8}" for r in range(layout.world)]
    fig = figures.group_crossings_figure(layout, 8)
    house_style("group crossings", fig)
    for d in ("tp", "cp", "dp", "pp"):
        across = len(layout.spans_hosts([d], hosts))
        assert list(bar(fig, f"{d} across nodes").x) == [across]
        assert list(bar(fig, f"{d} inside a node").x) == [len(layout.groups(d)) - across]
    assert bar(fig, "tp across nodes").x[0] == 0 and bar(fig, "pp inside a node").x[0] == 0
    assert "Which dims cross nodes: cp, dp, pp" in fig.layout.title.text
    hsdp = group_crossings(MeshLayout.of(ParallelConfig(dp=16, dp_replicate=2, sharding="fsdp")), 8)
    assert [(r["dim"], r["across nodes"]) for r in hsdp] == [("dp_shard", 0), ("dp_replicate", 8)]


def test_context_kinds_at_scale_draw_the_planners_bytes_and_exposed_time():
    placements = {
        "cp in a node": ParallelConfig(
            cp=8, dp=8, global_batch=8, order="tp-cp-ep-dp-pp", precision="bf16", sharding="fsdp"
        ),
        "cp across nodes": ParallelConfig(
            cp=8, dp=8, global_batch=8, order="tp-dp-ep-cp-pp", precision="bf16", sharding="fsdp"
        ),
    }
    seqs = (16384, 65536)
    rows = context_at_scale(LLAMA_8B, placements, seqs)
    assert len(rows) == 2 * 4 * len(seqs)
    # one row against the planner asked directly
    row = next(r for r in rows if (r["placement"], r["kind"], r["seq"]) == ("cp across nodes", "ulysses", 65536))
    plan = theory.evaluate(placements["cp across nodes"].replace(cp_kind="ulysses"), LLAMA_8B.replace(seq=65536))
    cp = next(r for r in plan.links() if r["dim"] == "cp")
    assert (row["GB sent"], row["exposed s"]) == (cp["GB sent"], plan.breakdown["time"]["exposed cp"])
    fig = figures.context_scale_figure(rows, "Llama 3.1 8B")
    house_style("context at scale", fig)
    for r in rows:
        col = 1 + list(placements).index(r["placement"])
        sent = next(t for t in fig.data if t.name == r["kind"] and t.xaxis == ("x" if col == 1 else f"x{col}"))
        exposed = next(t for t in fig.data if t.name == f"{r['kind']} exposed" and t.xaxis.endswith(str(col + 2)))
        i = list(sent.x).index(r["seq"])
        assert (sent.y[i], exposed.y[i]) == (r["GB sent"], r["exposed s"])
    best = best_kinds(rows)
    for (where, seq), kind in best.items():
        mine = [r for r in rows if (r["placement"], r["seq"]) == (where, seq)]
        assert max(mine, key=lambda r: r["tokens/s/GPU"])["kind"] == kind
    assert best["cp in a node", 65536] in fig.layout.title.text


def test_the_scale_explorer_shows_the_chosen_layouts_links():
    x = ScaleExplorer(model="llama-7b", gpus=64, tp=8)
    x.wait()
    drawn = x.figures["links"]
    want = figures.links_figure({x.view.plan.layout(): x.view.plan})
    assert [(t.name, list(t.x)) for t in drawn.data] == [(t.name, list(t.x)) for t in want.data]
    x.controls["sharding"].value = "fsdp"
    x.wait()
    assert {t.name for t in x.figures["links"].data} == {r["dim"] for r in x.view.plan.links() if r["dim"] != "total"}
    assert x.figures["links"].data[0].y[0][0] == x.view.plan.layout()
    total = next(r for r in x.view.plan.links() if r["dim"] == "total")
    assert (
        f"{total['GB across nodes']:,.3g} of the {total['GB sent']:,.3g} GB it sends"
        in x.figures["links"].layout.title.text
    )


def _luminance(color: str) -> float:
    """WCAG 2.1's relative luminance of an sRGB colour '#RRGGBB'."""
    c = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    lin = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def test_every_figure_carries_its_own_paper_and_ink():
    """Opaque paper and dark ink in every figure, 7:1 or more apart (WCAG 2.1 AAA for small text): a
    figure reads alike in JupyterLab's light and dark themes, whose page never shows through."""
    from test_figures import FIGURES

    assert (_luminance(PAPER) + 0.05) / (_luminance(INK) + 0.05) >= 7
    for name, fig in FIGURES:  # the older builders; each new one is held to it where its data is tested
        assert fig.layout.paper_bgcolor == PAPER and fig.layout.plot_bgcolor == PAPER, name
        assert fig.layout.font.color == INK, name


def test_each_rank_and_dim_has_one_colour():
    assert len({rank_color(r) for r in range(64)}) == 64
    assert rank_color(3) == rank_color(3) and dim_color("cp ring") == dim_color("cp")
    assert len({dim_color(d) for d in ("dp", "tp", "pp", "cp", "ep", "dp_shard", "dp_replicate")}) == 7
    assert dim_color("dp-cp") not in {dim_color(d) for d in ("dp", "cp")}
