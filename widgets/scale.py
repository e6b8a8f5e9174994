"""ScaleExplorer: the theory at scale, no cluster — a published model on up to 16k GPUs.

    ScaleExplorer()                       # Llama-70B on 1,024 GPUs; change anything

Memory per GPU (one rank of each pipeline stage) against an 80 GB line, model states for each
ZeRO stage, bytes each GPU sends per step by dim, and the pipeline bubble. Everything comes
from labkit.theory's per-rank functions (`rank_memory`, `rank_comm`, `model_state_bytes`,
`pipeline_bubble`), so the explorer shows whatever the theory models and grows with it. Below
them the planner (widgets/plans.py): what the fullest GPU holds under the layout, every term of
theory/planner/gpu_memory.py by name, the step's time on the chosen hardware, and the best layouts of the
model on these GPUs (theory.plan), a click on one setting every control to it.

Why not `theory.estimate`: it fills every class of rank (20-70 ms for Llama-70B on 16k GPUs,
but 2.1 s under FSDP2, whose shards differ by index), and the explorer shows one rank per
stage and redraws within 100 ms. Here memory is asked for one rank per pipeline stage (ranks
that differ only in dp/tp/cp/ep coordinates are alike in every strategy's theory), and
communication for those ranks only (`theory.rank_comm`), with the gradient buckets merged
into one (the ring model is linear in the bytes, so the per-step total is the same; only the
call count changes). A layout with many parameter tensors and ranks still computes its comm
rows in a background thread, stopped when the controls move on, and the comm figure follows
when it is done (the rest updates at once).
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W
import plotly.graph_objects as go

from labkit import theory
from labkit.config import CONTEXT_KINDS, LOSSES, PRECISIONS, SHARDINGS, ModelConfig, ParallelConfig
from labkit.config.choices import Precision, Sharding, context_comm
from labkit.theory.planner.evaluate import layout_problems
from labkit.theory.planner.hardware import HARDWARE, hardware_of
from labkit.theory.presets import PRESETS
from labkit.widgets import theory_figures as TF
from labkit.widgets.at_scale import AtScale, at_scale, comm_at_scale, comm_cached, comm_work
from labkit.widgets.controls import button_width
from labkit.widgets.figures import empty_figure
from labkit.widgets.live import UI, figure_widget, refresh
from labkit.widgets.planner_figures import links_figure
from labkit.widgets.plans import PlanPanel, gpu_memory_figure

SYNC_WORK = 400_000
"""Ranks x parameter tensors below which the comm rows are computed at once (~50 ms)."""
# the memory sizes GPUs are sold with, in GB of 1e9 bytes as vendors count
CAPACITIES = {"80 GB (A100, H100)": 80e9, "141 GB (H200)": 141e9, "192 GB (B200, MI300X)": 192e9}


def _powers(limit: int, divides: int | None = None) -> list[int]:
    out, v = [], 1
    while v <= limit:
        if divides is None or divides % v == 0:
            out.append(v)
        v *= 2
    return out


def _a2a(c: dict) -> int:
    """cp_kind='hierarchical': the all-to-all's ranks, the largest proper divisor of cp whose run
    (tp · cp_a2a consecutive ranks, tp innermost) stays inside a node; 1 (refused) when cp has none."""
    node = hardware_of(c["hardware"]).gpus_per_node
    fits = [a for a in range(2, c["cp"]) if c["cp"] % a == 0 and c["tp"] * a <= node]
    return max(fits, default=1)


class ScaleExplorer:
    """Controls for a model preset, a GPU count and the parallel degrees; five live figures (the
    lab theory's memory per stage, model states per ZeRO stage, communication, bubble, and the
    planner's GPU memory term by term); the planner's best layouts, a click opens one.
    `.controls` (name -> widget), `.figures` (name -> LiveFigure), `.view` (the AtScale shown),
    `.plans` (the PlanPanel), `.timings` (seconds of the last update), `.wait()` (for a comm
    computation in the background)."""

    def __init__(
        self,
        model: str = "llama-70b",
        gpus: int = 1024,
        tp: int = 8,
        pp: int = 1,
        microbatches: int = 1,
        precision: Precision = "bf16",
        sharding: Sharding = "none",
    ):
        # one description width for every control, so the sliders line up in their columns
        box = dict(style={"description_width": "120px"}, layout=W.Layout(width="330px"))
        sel = lambda name, opts, v: W.SelectionSlider(
            options=opts,
            value=v,
            description=name,  # noqa: E731
            # the theory runs once a slider is let go, not at every value a drag passes
            continuous_update=False,
            **box,
        )
        self.controls: dict[str, W.Widget] = {
            "model": W.Dropdown(options=list(PRESETS), value=model, description="model", **box),
            # up to 16,384 GPUs: Llama 3 405B's pretraining run; the degrees' options come from the model
            "gpus": sel("GPUs", _powers(16384), gpus),
            "tp": sel("tp", [1], 1),
            "pp": sel("pp", [1], 1),
            "cp": sel("cp", [1], 1),
            "ep": sel("ep", [1], 1),
            "microbatches": sel("microbatches", _powers(128), microbatches),
            "micro_batch": W.IntSlider(
                value=1, min=1, max=64, description="seqs / microbatch", continuous_update=False, **box
            ),
            "virtual_stages": sel("virtual stages", [1, 2, 4, 8], 1),
            "schedule": W.ToggleButtons(
                # the schedules whose bubble has the closed form the bubble figure draws, (p-1)/(v·m+p-1)
                options=["gpipe", "1f1b", "interleaved"],
                value="1f1b",
                description="schedule",
                style={"button_width": button_width(["gpipe", "1f1b", "interleaved"])},
            ),
            "sharding": W.ToggleButtons(
                options=list(SHARDINGS),
                value=sharding,
                description="sharding",
                style={"button_width": button_width(SHARDINGS)},
            ),
            "cp_kind": W.ToggleButtons(
                options=list(CONTEXT_KINDS),
                value="ring",
                description="cp kind",
                style={"button_width": button_width(CONTEXT_KINDS)},
            ),
            "precision": W.ToggleButtons(
                options=list(PRECISIONS),
                value=precision,
                description="precision",
                style={"button_width": button_width(PRECISIONS)},
            ),
            "sequence_parallel": W.Checkbox(value=False, description="sequence_parallel", indent=False),
            "checkpoint_activations": W.ToggleButtons(
                # (label, value): the config spells none and full as False and True
                options=[("none", False), ("selective", "selective"), ("op", "op"), ("full", True)],
                value=False,
                description="recompute",
                style={"button_width": button_width(["none", "selective", "op", "full"])},
            ),
            "loss": W.ToggleButtons(
                options=list(LOSSES),
                value="fp32",
                description="loss",
                tooltip="fused: the logits kept in the compute dtype, not fp32 log-probabilities (ModelConfig.loss)",
                style={"button_width": button_width(LOSSES)},
            ),
            "capacity": W.Dropdown(options=list(CAPACITIES), value=list(CAPACITIES)[0], description="GPU", **box),
            "hardware": W.Dropdown(options=list(HARDWARE), value="h100", description="time on", **box),
        }
        self.stage_layers: tuple[int, ...] = ()
        """Uneven pipeline stages, set when a plan that has them is opened (no control of its own)."""
        self._degree_options(tp=tp, pp=pp)
        self.ui = UI()
        names = ("memory", "zero", "comm", "bubble", "gpu", "links")
        self.figures = {n: figure_widget(go.Figure(), height=340) for n in names}
        self.plans = PlanPanel(self._question, self.open_plan)
        self.status = W.HTML().add_class("labkit-scale-status")
        self.error_box = W.HTML()
        self.view: AtScale | None = None
        self.timings: dict[str, float] = {}
        self._lock = threading.Lock()
        self._comm_thread: threading.Thread | None = None
        self._stale = threading.Event()
        # True while several controls change together (a new model, an opened plan): one redraw at the end
        self._holding = False
        for name, w in self.controls.items():
            # a new model first changes which degrees are allowed, then redraws
            w.observe(self._model_changed if name == "model" else self._changed, names="value")
        c, f = self.controls, self.figures
        col = lambda *ws: W.VBox(list(ws))  # noqa: E731
        self.widget = W.VBox(
            [
                W.HBox(
                    [
                        col(c["model"], c["gpus"], c["capacity"], c["hardware"], c["micro_batch"]),
                        col(c["tp"], c["pp"], c["cp"], c["ep"]),
                        col(c["microbatches"], c["virtual_stages"], c["sequence_parallel"]),
                    ]
                ),
                col(c["schedule"], c["sharding"], c["cp_kind"], c["precision"], c["checkpoint_activations"], c["loss"]),
                self.plans.widget,
                self.status,
                self.error_box,
                W.HBox(
                    [
                        W.VBox([f["memory"]], layout=W.Layout(width="50%")),
                        W.VBox([f["zero"]], layout=W.Layout(width="50%")),
                    ]
                ),
                W.HBox(
                    [
                        W.VBox([f["comm"]], layout=W.Layout(width="50%")),
                        W.VBox([f["bubble"]], layout=W.Layout(width="50%")),
                    ]
                ),
                f["gpu"],
                f["links"],
            ]
        ).add_class("labkit-scale")
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def model(self) -> ModelConfig:
        return PRESETS[self.controls["model"].value].replace(loss=self.controls["loss"].value)

    def _degree_options(self, **values) -> None:
        """Offer the degrees the model allows: tp | heads, vocab and ffn (GPT-2's vocab 50257 is odd:
        tp 1), pp | layers, 2cp | seq, ep | experts."""
        m, c = self.model, self.controls
        opts = {
            "tp": [t for t in _powers(128, m.heads) if m.vocab % t == 0 and m.ffn % t == 0],
            # even stages only here: an uneven split comes from a plan opened in the panel
            "pp": [p for p in range(1, min(m.layers, 128) + 1) if m.layers % p == 0],
            "cp": [x for x in _powers(64) if m.seq % (2 * x) == 0],
            "ep": [x for x in range(1, max(m.experts, 1) + 1) if max(m.experts, 1) % x == 0],
        }
        for d, o in opts.items():
            want = values.get(d, c[d].value)
            c[d].options = o
            # a degree the model does not allow falls back to 1, which every model allows
            c[d].value = want if want in o else 1

    def _changed(self, change) -> None:
        if not self._holding:
            if getattr(change, "owner", None) in (self.controls["pp"], self.controls["virtual_stages"]):
                self.stage_layers = ()  # a pipeline chosen by hand is split evenly
            self.update()

    def _question(self) -> tuple:
        """What the planner is asked: the model, the GPUs, the global batch the controls give, the hardware."""
        cfg, _ = self.config()
        # no valid layout yet: ask for one sequence per GPU
        gb = cfg.global_batch if cfg is not None else self.controls["gpus"].value
        return self.model, self.controls["gpus"].value, gb, self.controls["hardware"].value

    def open_plan(self, plan: theory.Plan) -> None:
        """Set every control to `plan`'s layout (one redraw)."""
        cfg, c = plan.config, self.controls
        self._holding = True
        try:
            for d in ("tp", "pp", "cp", "ep", "microbatches", "virtual_stages"):
                if getattr(cfg, d) not in c[d].options:
                    c[d].options = sorted({*c[d].options, getattr(cfg, d)})
                c[d].value = getattr(cfg, d)
            # the control counts sequences per microbatch on one data rank: the global batch gives it back
            c["micro_batch"].value = cfg.global_batch // (cfg.dp * cfg.ep * cfg.microbatches)
            for name in ("schedule", "sharding", "cp_kind", "precision", "sequence_parallel", "checkpoint_activations"):
                c[name].value = getattr(cfg, name)
            self.stage_layers = cfg.stage_layers
        finally:
            self._holding = False
        self.update()

    def _model_changed(self, _) -> None:
        self._holding = True
        try:
            self._degree_options()
        finally:
            self._holding = False
        self.update()

    def config(self) -> tuple[ParallelConfig | None, list[str]]:
        """The layout the controls describe (dp = GPUs / (tp·pp·cp·ep)), or the reasons there is none."""
        c = {k: w.value for k, w in self.controls.items()}
        rest = c["tp"] * c["pp"] * c["cp"] * c["ep"]
        if c["gpus"] % rest:
            return None, [f"GPUs ({c['gpus']}) are not divisible by tp·pp·cp·ep = {rest}: dp would not be whole"]
        dp = c["gpus"] // rest
        cfg = ParallelConfig(
            dp=dp,
            tp=c["tp"],
            pp=c["pp"],
            cp=c["cp"],
            ep=c["ep"],
            sharding=c["sharding"],
            microbatches=c["microbatches"],
            schedule=c["schedule"],
            virtual_stages=c["virtual_stages"],
            precision=c["precision"],
            sequence_parallel=c["sequence_parallel"],
            checkpoint_activations=c["checkpoint_activations"],
            # the kinds differ only with cp > 1 (validation refuses a kind without it): the ring stands in
            cp_kind=c["cp_kind"] if c["cp"] > 1 else "ring",
            cp_a2a=_a2a(c) if context_comm(c["cp_kind"]).hierarchical and c["cp"] > 1 else 1,
            # dp·ep data ranks, each m microbatches of micro_batch sequences (batch.microbatch_rows, inverted)
            global_batch=dp * c["ep"] * c["microbatches"] * c["micro_batch"],
        )
        # the opened plan's uneven stages only while pp · virtual stages still match them
        if self.stage_layers and len(self.stage_layers) == cfg.pp * cfg.virtual_stages:
            cfg = cfg.replace(stage_layers=self.stage_layers)
        return cfg, layout_problems(cfg, self.model)

    def update(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        cfg, found = self.config()
        if found:
            self.error_box.value = (
                "<pre style='color:#B00020;white-space:pre-wrap'>" + html.escape("\n".join(found)) + "</pre>"
            )
            return
        self.error_box.value = ""
        model = self.model
        self._stale.set()  # a comm walk still running for an older layout stops
        self._stale = threading.Event()
        # cheap or remembered: the comm rows now; else on a thread, and everything else draws first
        now = comm_work(cfg, model) <= SYNC_WORK or comm_cached(cfg, model)
        view = at_scale(cfg, model, comm=now, hardware=self.controls["hardware"].value)
        # the comm thread reads self.view under the lock to tell whether its work still matters
        with self._lock:
            self.view = view
        self._draw(view)
        self.timings = {"update": time.perf_counter() - t0, "update_cpu": time.thread_time() - c0}
        # the links (Plan.links(): the exact theory's comm rows with the layout's own buckets) and, when
        # large, the comm rows follow from a thread; daemon: a walk left running never holds up the exit
        self._comm_thread = threading.Thread(target=self._comm_later, args=(view, self._stale, not now), daemon=True)
        self._comm_thread.start()

    def _comm_later(self, view: AtScale, stale: threading.Event, comm_too: bool) -> None:
        if comm_too:
            comm = comm_at_scale(view.config, view.model, stale)
            with self._lock:
                if comm is None or self.view is not view:
                    return  # the controls moved on; their own update draws
                view.comm, view.comm_pending = comm, False
            # widget state goes out on the kernel's thread only (live.UI): this runs on the comm thread
            self.ui.call(refresh, self.figures["comm"], TF.stage_comm_figure(view), height=340)
        try:
            links = links_figure({view.plan.layout(): view.plan})
        except Exception as e:  # noqa: BLE001 — a thread has no caller to raise to: the panel says why
            links = empty_figure("What crosses nodes", f"{type(e).__name__}: {e}")
        with self._lock:
            if self.view is not view:
                return
        self.ui.call(refresh, self.figures["links"], links)

    def _draw(self, view: AtScale) -> None:
        cap = CAPACITIES[self.controls["capacity"].value]
        cfg = view.config
        tokens = cfg.global_batch * view.model.seq
        self.status.value = (
            f"Ψ = {view.psi / 1e9:,.2f} B parameters · {cfg.world:,} GPUs = dp {cfg.dp} × tp {cfg.tp} × pp {cfg.pp}"
            f" × cp {cfg.cp} × ep {cfg.ep} · global batch {cfg.global_batch:,} sequences ({tokens / 1e6:,.1f} M tokens)"
            f" · max {view.peak / 1e9:,.1f} GB per GPU · bubble {view.bubble:.1%}"
            f" · on {view.plan.hardware}: {view.plan.tokens_per_second_per_gpu:,.0f} tokens/s/GPU,"
            f" MFU {view.plan.mfu:.0%}, {view.plan.bound}-bound"
        )
        figs = {
            "memory": TF.stage_memory_figure(view, cap),
            "zero": TF.zero_figure(view, cap),
            "comm": TF.stage_comm_figure(view),
            "bubble": TF.bubble_figure(view),
            "gpu": gpu_memory_figure(view.plan),
        }
        for name, fig in figs.items():
            refresh(self.figures[name], fig, height=340)

    def wait(self, timeout: float | None = None) -> AtScale:
        """Block until a comm computation in the background (if any) has drawn."""
        t = self._comm_thread
        if t is not None:
            t.join(timeout)
        if self.ui.here:
            self.ui.flush()
        return self.view
