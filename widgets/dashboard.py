"""The live dashboard: controls for a layout, a warm cluster running it, every figure redrawn.

    from labkit.widgets import Dashboard
    dash = Dashboard(lab)          # shows itself as a notebook cell's value
    dash.controls["dp"].value = 2  # what a person does with the slider
    dash.wait()                    # scripts and tests: block until the run and redraw are done
    dash.result                    # the last RunResult

A change of any control narrows the other sliders to what fits, validates the layout (an
invalid one shows its ConfigError inline and does not run) and, after a short debounce, asks
the one background thread to run it (widgets/run_queue.py). The Lab is not safe to call
concurrently, so that thread is the only caller and runs are serialised; the kernel's thread only
reads controls and draws the mesh, so the notebook stays responsive while a run is in flight. The figures are
rebuilt from the result by the pure builders in figures.py and shown in place (live.refresh).
"""

from __future__ import annotations

import contextlib
import html
import time

import ipywidgets as W

from labkit import theory
from labkit.cluster.errors import Cancelled, LabError
from labkit.config import DIMS, ConfigError, ModelConfig, ParallelConfig
from labkit.config.validation import problems, validate
from labkit.layout.mesh import COMBINED, MeshLayout
from labkit.oracle.reference import reference
from labkit.widgets import figures
from labkit.widgets.controls import DEGREES, config_of, make_controls, sync_options
from labkit.widgets.device import total_memory
from labkit.widgets.live import UI, figure_widget, refresh
from labkit.widgets.run_queue import RunQueue

TITLES = {f.name: f.title for f in figures.RUN_FIGURES if f.on_dashboard} | {"mesh": "Mesh"}
"""The panels: the run's figures the Dashboard shows (widgets/figures.py RUN_FIGURES) and the mesh view."""
NAMES = tuple(TITLES)
ROWS = (("memory", "comm"), ("timeline", "traffic"), ("mesh", "loss"))
"""The panels two a row; a panel no row names is laid out after these (`_grid`)."""
SIZE = dict(height=360)
"""Fixed height; the width is the cell's (two figures a row), which a live figure follows
(widgets/live_figure.js resizes a figure drawn before its cell was laid out)."""


def describe(cfg: ParallelConfig) -> str:
    """One line for the status: the mesh, then whatever differs from the defaults."""
    # against the defaults: the status line names only what the user changed
    base = ParallelConfig()
    parts = [MeshLayout.of(cfg).describe()]
    for f in (
        "sharding",
        "dp_replicate",
        "microbatches",
        "schedule",
        "virtual_stages",
        "global_batch",
        "impl",
        "precision",
        "sequence_parallel",
        "checkpoint_activations",
        "order",
        "bucket_mb",
        "cp_kind",
        "cp_a2a",
    ):
        if getattr(cfg, f) != getattr(base, f):
            parts.append(f"{f}={getattr(cfg, f)}")
    return ", ".join(parts)


def default_config(model: ModelConfig, engines: int) -> ParallelConfig:
    """Data parallelism over as many engines as the batch splits evenly over."""
    # the largest dp that works first: the first run uses every engine it can
    for dp in range(engines, 0, -1):
        cfg = ParallelConfig(dp=dp)
        if not problems(cfg, model, engines):
            return cfg
    return ParallelConfig()


class Dashboard:
    """Controls, status and six live figures for one Lab (see the module docstring).

    lab: a started Lab (its engines stay warm between runs).
    cfg, model: the first layout and the model (default: dp over the engines, ModelConfig()).
    steps, seed: per run. debounce: seconds a control must rest before a run starts.
    run: run the first layout at once. capacity_bytes: the memory figure's device line (default:
    the smallest GPU's memory when the engines have GPUs, none on CPU).
    """

    def __init__(
        self,
        lab,
        cfg: ParallelConfig | None = None,
        model: ModelConfig | None = None,
        steps: int = 3,
        seed: int = 0,
        debounce: float = 0.15,
        run: bool = True,
        capacity_bytes: float | None = None,
    ):
        self.lab = lab
        self.model = model or ModelConfig()
        self.engines = lab.world
        self.seed = seed
        self.debounce = debounce
        self.capacity_bytes = capacity_bytes
        cfg = cfg or default_config(self.model, self.engines)
        self.controls = make_controls(cfg, self.model, self.engines, steps)
        # every dim, and the combined dims short of all five (the whole mesh is one group: one colour)
        dims = list(DIMS) + ["-".join(c) for c in COMBINED if len(c) < len(DIMS)]
        self.mesh_dim = W.Dropdown(options=dims, value="dp", description="colour by", layout=W.Layout(width="220px"))
        self.ui = UI()
        self.figures = {n: figure_widget(figures.empty_figure(TITLES[n]), **SIZE) for n in NAMES}
        self.status = W.HTML(layout=W.Layout(width="640px")).add_class("labkit-status")
        self.progress = W.IntProgress(value=0, min=0, max=steps, description="step", layout=W.Layout(width="260px"))
        self.cancel_button = W.Button(description="cancel", icon="stop", disabled=True, button_style="warning")
        self.error_box = W.HTML().add_class("labkit-error")
        # the panel a VerifyReport is drawn in (show(..., verified=)): empty, and taking no room, until then
        self.verified = W.VBox([]).add_class("labkit-verified")
        self.result = None
        self.reference = None
        self.error: Exception | None = None
        self.runs = 0
        self.timings: dict[str, float] = {}
        # one-process references already trained, by what they depend on: a change of layout alone reuses one
        self._refs: dict[tuple, object] = {}
        # True while code sets controls (sync_options, set): their observers must not start a run each
        self._syncing = False
        self.widget = self._assemble()
        for w in self.controls.values():
            w.observe(self._changed, names="value")
        self.mesh_dim.observe(lambda _: self._draw_mesh(config_of(self.controls)), names="value")
        self.cancel_button.on_click(lambda _: self.cancel())
        self.queue = RunQueue(lambda request: self._run(*request), self._failed, name="labkit-dashboard")
        self._changed(None, schedule=run)

    # -- what the notebook shows ------------------------------------------------------------
    def _assemble(self) -> W.Widget:
        c = self.controls
        col = lambda *ws: W.VBox(list(ws), layout=W.Layout(margin="0 12px 0 0", flex="0 0 auto"))  # noqa: E731
        knobs = W.HBox(
            layout=W.Layout(flex_flow="row wrap"),
            children=[
                col(*(c[d] for d in DEGREES), c["dp_replicate"]),
                col(c["microbatches"], c["virtual_stages"], c["global_batch"], c["cp_a2a"], c["bucket_mb"], c["steps"]),
                col(c["schedule"], c["sharding"], c["impl"], c["precision"], c["cp_kind"], c["order"]),
                col(c["sequence_parallel"], c["checkpoint_activations"], c["reshard_after_forward"]),
            ],
        )
        hosts = sorted(set(self.lab.hosts))
        head = W.HTML(
            f"<b>labkit</b> · {self.engines} engines on {', '.join(map(html.escape, hosts))} "
            f"· {html.escape(str(self.lab.devices[0]))} · model Ψ = {theory.num_params(self.model):,}"
        )
        grid = self._grid()
        return W.VBox(
            [head, knobs, W.HBox([self.status, self.progress, self.cancel_button]), self.error_box, self.verified, grid]
        ).add_class("labkit-dashboard")

    def _grid(self) -> W.VBox:
        placed = {n for row in ROWS for n in row}
        rest = [n for n in NAMES if n not in placed]
        rows = [*ROWS, *(tuple(rest[i : i + 2]) for i in range(0, len(rest), 2))]
        # the mesh view's dim selector sits above it
        cell = lambda n: W.VBox(  # noqa: E731
            [self.mesh_dim, self.figures[n]] if n == "mesh" else [self.figures[n]], layout=W.Layout(width="50%")
        )
        return W.VBox([W.HBox([cell(n) for n in row]) for row in rows])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _set(self, widget: W.Widget, **values) -> None:
        """Set widget traits from any thread (on the kernel's thread, see live.UI)."""
        self.ui.call(lambda: [setattr(widget, k, v) for k, v in values.items()])

    def _say(self, text: str) -> None:
        self._set(self.status, value=f"<span>{html.escape(text)}</span>")

    def _show_error(self, text: str) -> None:
        self._set(
            self.error_box,
            value=(f"<pre style='color:#B00020;white-space:pre-wrap;margin:4px 0'>{html.escape(text)}</pre>")
            if text
            else "",
        )

    # -- controls -> validated layout -> pending run ----------------------------------------
    @contextlib.contextmanager
    def _guard(self):
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    def _changed(self, change, schedule: bool = True) -> None:
        if self._syncing:
            return
        with self._guard():
            # the sliders are narrowed first, so the layout read next is one the controls can show
            sync_options(self.controls, self.model, self.engines)
        cfg = config_of(self.controls)
        # drawn before validation: an invalid layout still shows its grid beside its error
        self._draw_mesh(cfg)
        try:
            validate(cfg, self.model, self.engines)
        except ConfigError as e:
            # a run still queued for the previous layout would draw figures the controls no longer describe
            self.queue.drop()
            self._show_error(str(e))
            self._say(f"{describe(cfg)}: not run (see below)")
            return
        self._show_error("")
        if not schedule:
            return
        # stamped when asked, so the timings tell the debounce and the queue apart from the run
        self.queue.put((cfg, self.controls["steps"].value, time.perf_counter()), self.debounce)
        self._say(f"{describe(cfg)}: queued" + (" after the run in flight" if self.queue.busy else ""))

    def _draw_mesh(self, cfg: ParallelConfig) -> None:
        if cfg.order.count("-") != len(DIMS) - 1 or sorted(cfg.order.split("-")) != sorted(DIMS):
            return  # an order still being typed; validate() explains it
        layout = MeshLayout.of(cfg)
        hosts, devices = self.lab.hosts[: layout.world], self.lab.devices[: layout.world]
        # more ranks than engines: no host or device to show for some (validate says why it does not run)
        if layout.world > self.engines:
            hosts = devices = None
        refresh(self.figures["mesh"], figures.mesh_figure(layout, self.mesh_dim.value, hosts, devices), **SIZE)

    # -- in the one thread that calls the Lab (self.queue) -----------------------------------
    def _failed(self, e: Exception) -> None:
        self.error = e
        self._show_error(f"{type(e).__name__}: {e}")

    def _run(self, cfg: ParallelConfig, steps: int, asked: float) -> None:
        self._set(self.progress, max=steps, value=0)
        self._set(self.cancel_button, disabled=False)
        self._say(f"{describe(cfg)}: running")
        t0 = time.perf_counter()
        # asked here, in the one thread that calls the Lab: lab.apply must not run beside a run
        if self.capacity_bytes is None and self.runs == 0:
            self.capacity_bytes = device_capacity(self.lab)
        try:
            res = self.lab.run(
                cfg, model=self.model, steps=steps, seed=self.seed, progress=lambda p: self._step(cfg, p)
            )
        except Cancelled:
            self._say(f"{describe(cfg)}: cancelled")
            return
        except (ConfigError, LabError) as e:
            self.error = e
            self._show_error(f"{type(e).__name__}: {e}")
            self._say(f"{describe(cfg)}: failed (see below)")
            return
        finally:
            self._set(self.cancel_button, disabled=True)
        t1 = time.perf_counter()
        self.error = None
        self.reference = self._reference(cfg, steps)
        t2 = time.perf_counter()
        self._draw(res)
        t3 = time.perf_counter()
        self.result = res
        self.runs += 1
        self.timings = {
            "debounce_and_queue": t0 - asked,
            "run": t1 - t0,
            "reference": t2 - t1,
            "figures": t3 - t2,
            "total": t3 - asked,
        }
        self._say(
            f"{describe(cfg)}: done, {steps} steps in {res.wall_seconds:.2f} s, loss {res.losses[-1]:.4f} "
            f"(figures {t3 - t2:.2f} s)"
        )

    def _step(self, cfg: ParallelConfig, p: dict) -> None:
        self._set(self.progress, value=p["step"] + 1)
        self._say(f"{describe(cfg)}: step {p['step'] + 1}/{p['steps']}, loss {p['loss']:.4f}, {p['seconds']:.2f} s")

    def _reference(self, cfg: ParallelConfig, steps: int):
        # the layout is not in the key: every layout is held to the same one process
        key = (self.model, steps, self.seed, cfg.global_batch, cfg.precision)
        if key not in self._refs:
            self._refs[key] = reference(
                self.model, steps=steps, seed=self.seed, global_batch=cfg.global_batch, precision=cfg.precision
            )
        return self._refs[key]

    def _draw(self, res) -> None:
        measured = not hasattr(res, "config")  # a Measurement (lab.measure): no layout, no loss
        try:
            est = None if measured else theory.estimate(res.config, res.model)
        # a layout the theory does not price: the figures draw without the theory's markers
        except ConfigError:
            est = None
        new = figures.report_figures(res, self.reference, est, self.capacity_bytes)
        new = {name: fig for name, fig in new.items() if name in self.figures}
        if measured:
            new["loss"] = figures.empty_figure(TITLES["loss"], "a measurement has no loss of its own")
        # built in this thread (the slow part), shown on the kernel's (live.UI)
        self.ui.call(self._show, new, None if measured else res.config)

    def _show(self, new: dict, cfg: ParallelConfig | None) -> None:
        for name, fig in new.items():
            refresh(self.figures[name], fig, **SIZE)
        if cfg is not None:
            # the run's own layout: the controls may have moved on while it ran
            self._draw_mesh(cfg)

    def show(self, result, verified=None) -> None:
        """Draw `result` in the panels: a RunResult, or a Measurement of your own code
        (Lab.measure: memory, communication, traffic and timeline; no loss). `verified`: a
        VerifyReport of the same code (Lab.verify), its verdict in the status line, its figure
        (figures.verify_figure: every tensor's error over its bound, the replicas per rank) in the
        verified panel and its card below, so that one view says both whether the code is right and
        what it moves."""
        self._draw(result)
        if verified is not None:
            self._say(verified.summary())
            self._set(self.error_box, value=verified._repr_html_())
            if "verified" not in self.figures:
                self.figures["verified"] = figure_widget(figures.empty_figure("verify"))
                self._set(self.verified, children=(self.figures["verified"],))
            self.ui.call(refresh, self.figures["verified"], figures.verify_figure(verified))
        if self.ui.here:
            self.ui.flush()

    # -- scripts and tests ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether a run is in flight on the cluster now."""
        return self.queue.busy

    def wait(self, timeout: float | None = None):
        """Block until no run is pending or in flight and its figures are drawn; the last result.
        Raises TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.ui.here:
                self.ui.flush()  # the kernel's thread is blocked here: run the updates it owes
            if self.queue.idle and not self.ui.pending:
                return self.result
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"the dashboard was still busy after {timeout} s")
            # short waits: the kernel's thread must come back to flush the updates the run posts
            self.queue.wait(0.02 if left is None else min(0.02, left))

    def set(self, **values) -> None:
        """Set several controls at once (one run): e.g. dash.set(dp=1, pp=4, microbatches=8)."""
        with self._guard():
            for f, v in values.items():
                w = self.controls[f]
                # a value the slider does not offer yet (sync_options would allow it only once the others change)
                if isinstance(w, W.SelectionSlider) and v not in w.options:
                    w.options = tuple(sorted(set(w.options) | {v}))
                w.value = v
        # one _changed for all the values: setting them one by one would queue a run each
        self._changed(None)

    def cancel(self) -> None:
        """Drop any queued run and ask the engines to stop the one in flight."""
        if self.queue.drop():
            self._say("cancelling…")
            self.lab.cancel()

    def close(self) -> None:
        """Stop the background thread (after the run in flight) and close the widgets."""
        self.queue.close(timeout=60)
        self.widget.close()


def device_capacity(lab) -> float | None:
    """Bytes of the smallest GPU among the engines, or None on CPU (no line is drawn)."""
    if not any(str(d).startswith("cuda") for d in lab.devices):
        return None
    return float(min(lab.apply(total_memory)))
