"""The planner in the ScaleExplorer: what one GPU holds under a layout, term by term (a pure
figure builder, `gpu_memory_figure`), and the planner's best layouts as a list a click opens
(`PlanPanel`). Both read labkit.theory's Plan (theory.evaluate, theory.plan)."""

from __future__ import annotations

import html

import ipywidgets as W
import plotly.graph_objects as go

from labkit import theory
from labkit.config import ModelConfig
from labkit.theory.planner.gpu_memory import ALLOCATED, OUTSIDE, TRANSIENT
from labkit.widgets.style import CATEGORY_COLORS, _figure, _layout, _level

GiB = 2**30
TERM_COLORS = {
    **CATEGORY_COLORS,
    "gathered": "#72B7B2",
    "reduce_buffers": "#EECA3B",
    "logits": "#B279A2",
    "recompute": "#FF9DA6",
    "temporaries": "#9D755D",
    "cuda_context": "#BAB0AC",
    "nccl": "#9D9D9D",
    "allocator": "#D8D8D8",
}


def gpu_memory_figure(plan: theory.Plan) -> go.Figure:
    """The fullest GPU's memory under `plan`, one bar per term of theory/planner/gpu_memory.py (a
    transient that does not count towards the peak, the smaller of the loss's and a block's
    backward, drawn hatched), against the hardware's memory."""
    mem = plan.memory
    counted_loss = mem["logits"] >= mem["recompute"] + mem["temporaries"]
    fig = _figure()
    for term in ALLOCATED + TRANSIENT + OUTSIDE:
        skipped = term in TRANSIENT and (term == "logits") != counted_loss
        fig.add_bar(
            name=term,
            x=[term],
            y=[mem[term] / GiB],
            marker_color=TERM_COLORS[term],
            marker_pattern_shape="/" if skipped else "",
            hovertemplate=f"{term}: %{{y:,.2f}} GiB" + (" (not at the peak)" if skipped else "") + "<extra></extra>",
        )
    fits = ("fits once the allocator gives back its cache" if plan.tight else "fits") if plan.fits else "does NOT fit"
    title = (
        f"One GPU, term by term: {mem['peak'] / GiB:,.1f} GiB at the peak ({fits}); "
        f"{plan.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, MFU {plan.mfu:.0%}, {plan.bound}-bound"
    )
    _level(fig, mem["peak"] / GiB, "peak (sum of the solid bars)", "#D62728")
    return _layout(fig, title, showlegend=False, yaxis_title="GiB")


class PlanPanel:
    """A button that asks the planner for the best layouts of the explorer's model, GPUs, global
    batch and hardware, and one button per layout found; clicking one calls `on_open(plan)`.
    `.plans` (the last answer), `.buttons`, `.widget`."""

    def __init__(self, ask, on_open, top: int = 5):
        self.ask, self.on_open, self.top = ask, on_open, top
        self.plans: list[theory.Plan] = []
        self.buttons: list[W.Button] = []
        self.find = W.Button(description="best layouts", icon="search", tooltip="theory.plan(...)")
        self.find.on_click(lambda _: self.search())
        self.note = W.HTML()
        self.list = W.VBox([])
        self.widget = W.VBox([W.HBox([self.find, self.note]), self.list]).add_class("labkit-plans")

    def search(self) -> None:
        model, gpus, global_batch, hardware = self.ask()
        found = theory.plan(model, gpus, hardware=hardware, global_batch=global_batch, top=self.top)
        self.show(found, model)

    def show(self, found, model: ModelConfig) -> None:
        self.plans = list(found)
        self.buttons = []
        for i, p in enumerate(self.plans):
            b = W.Button(
                description=f"{i + 1}. {p.tokens_per_second_per_gpu:,.0f} tok/s/GPU · {p.layout()}",
                layout=W.Layout(width="auto"),
                tooltip=f"MFU {p.mfu:.0%}, {p.peak_bytes / GiB:,.1f} GiB, {p.bound}-bound: open this layout",
            )
            b.on_click(lambda _, p=p: self.on_open(p))
            self.buttons.append(b)
        self.list.children = self.buttons
        misses = ", ".join(f"{n:,} {why}" for why, n in sorted(found.counts.items(), key=lambda x: -x[1])[:2])
        self.note.value = html.escape(
            f"{found.considered:,} layouts priced, {found.timed:,} timed; {len(self.plans)} shown"
            + (f"; rejected: {misses}" if misses else "")
        )
