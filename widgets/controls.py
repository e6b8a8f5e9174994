"""Controls for a ParallelConfig: one ipywidget per field, offering only values that fit.

Which values fit is not written down twice: a value is offered when setting it adds no
problem that `labkit.config.validation.problems` would report (degrees whose product exceeds the engines,
heads % tp, layers % (pp * virtual_stages), seq % 2cp, global_batch % (dp * ep * microbatches),
...). So the offered values follow the config's own arithmetic as it grows. Layouts that are
arithmetically fine but not built yet stay selectable: `validate` refuses them and the
dashboard shows why, and they light up when their strategy lands.
"""

from __future__ import annotations

import ipywidgets as W

from labkit.config import CONTEXT_KINDS, IMPLS, PRECISIONS, SCHEDULES, SHARDINGS, ModelConfig, ParallelConfig
from labkit.config.validation import problems

DEGREES = ("dp", "tp", "pp", "cp", "ep")
SLIDERS = DEGREES + ("dp_replicate", "microbatches", "virtual_stages", "global_batch", "cp_a2a")
"""Numeric fields whose offered values are narrowed to those that fit."""
CHOICES = {
    "sharding": SHARDINGS,
    "schedule": SCHEDULES,
    "impl": IMPLS,
    "precision": PRECISIONS,
    "cp_kind": CONTEXT_KINDS,
}
FLAGS = ("sequence_parallel", "checkpoint_activations", "reshard_after_forward")
BUCKETS_MB = (0.01, 0.05, 0.25, 1.0, 5.0, 25.0, 100.0)
ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-dp-ep-pp", "tp-ep-cp-dp-pp", "dp-tp-cp-ep-pp", "pp-tp-cp-ep-dp")
"""Orders offered in the list (any other can be typed): Megatron's default first."""
LIMITS = {"dp_replicate": 8, "microbatches": 64, "virtual_stages": 8, "global_batch": 64, "cp_a2a": 8}
FIELDS = SLIDERS + tuple(CHOICES) + FLAGS + ("bucket_mb", "order")
"""Every ParallelConfig field the dashboard controls."""
HELP = {
    "dp": "data-parallel replicas",
    "dp_replicate": "HSDP: replicas of dp / dp_replicate shard groups (needs a sharding)",
    "tp": "tensor-parallel ranks (heads, MLP width, vocab split)",
    "pp": "pipeline stages",
    "cp": "context-parallel ranks (sequence split, ring attention)",
    "ep": "expert-parallel ranks (MoE)",
    "microbatches": "microbatches per step",
    "virtual_stages": "model chunks per pipeline rank (interleaved)",
    "global_batch": "sequences per optimizer step",
    "cp_a2a": "cp_kind='hierarchical': ranks of each all-to-all (the ring runs across cp / cp_a2a)",
    "bucket_mb": "gradient bucket size (MiB)",
    "order": "mesh order, innermost first",
    "steps": "training steps per run",
}


LABEL = "110px"
"""Controls' label column: 'virtual_stages' in full at JupyterLab's 13 px font."""


def button_width(options) -> str:
    """ToggleButtons wide enough for their longest label (~9 px a character, 30 px of padding)."""
    return f"{9 * max(len(str(o)) for o in options) + 30}px"


def offered(field: str, cfg: ParallelConfig, model: ModelConfig, engines: int) -> list[int]:
    """Values of a numeric field that add no problem to `cfg` (the current value always stays)."""
    current = getattr(cfg, field)
    # problems already there are not this field's doing: a value is judged by what it adds
    before = set(problems(cfg, model, engines))
    # a degree is at most the engines; other fields go up to their limit, or to the value already set
    values = range(1, (engines if field in DEGREES else max(LIMITS[field], current)) + 1)
    # inclusion, not equality: a value that also clears a problem is offered
    out = [v for v in values if v == current or set(problems(cfg.replace(**{field: v}), model, engines)) <= before]
    # the current value stays even with problems of its own: dropping it would move the slider
    return sorted(set(out) | {current})


def _slider(field: str, value, options) -> W.SelectionSlider:
    return W.SelectionSlider(
        options=options,
        value=value,
        description=field,
        continuous_update=False,
        tooltip=HELP.get(field, ""),
        style={"description_width": LABEL},
        layout=W.Layout(width="330px"),
    )


def make_controls(cfg: ParallelConfig, model: ModelConfig, engines: int, steps: int = 3) -> dict[str, W.Widget]:
    """field -> ipywidget for every field in FIELDS, plus 'steps' (per run)."""
    c: dict[str, W.Widget] = {}
    for f in SLIDERS:
        c[f] = _slider(f, getattr(cfg, f), offered(f, cfg, model, engines))
    for f, opts in CHOICES.items():
        c[f] = W.ToggleButtons(
            options=list(opts),
            value=getattr(cfg, f),
            description=f,
            style={"description_width": LABEL, "button_width": button_width(opts)},
        )
    for f in FLAGS:
        c[f] = W.Checkbox(value=getattr(cfg, f), description=f, indent=False)
    # the config's own size joins the list: a SelectionSlider must offer its value
    c["bucket_mb"] = _slider("bucket_mb", cfg.bucket_mb, sorted(set(BUCKETS_MB) | {cfg.bucket_mb}))
    c["order"] = W.Combobox(
        value=cfg.order,
        options=list(ORDERS),
        description="order",
        # any order can be typed, not only the listed ones; applied on Enter, not at every key
        ensure_option=False,
        continuous_update=False,
        style={"description_width": LABEL},
        layout=W.Layout(width="330px"),
    )
    c["steps"] = W.IntSlider(
        value=steps,
        min=1,
        max=20,
        description="steps",
        continuous_update=False,
        style={"description_width": LABEL},
        layout=W.Layout(width="330px"),
    )
    for f, w in c.items():
        w.add_class(f"labkit-{f.replace('_', '-')}")  # stable handles for the browser test and CSS
    return c


def config_of(controls: dict[str, W.Widget], base: ParallelConfig | None = None) -> ParallelConfig:
    """The ParallelConfig the controls show (fields without a control keep `base`'s values)."""
    return (base or ParallelConfig()).replace(**{f: controls[f].value for f in FIELDS if f in controls})


def sync_options(controls: dict[str, W.Widget], model: ModelConfig, engines: int) -> None:
    """Narrow every numeric slider to the values that fit the others' current values.

    ipywidgets resets a selection's value when its options change, so the value is put back
    at once; callers ignore the change events this makes (see Dashboard._guard). Both go to the
    browser in one message (hold_sync): sent apart, the slider showed the reset value first, and the
    browser could send that index back after the kernel had put the value back — a run of a layout
    the controls no longer showed (a CI run: tp 2 -> 1 ran dp 2)."""
    cfg = config_of(controls)
    for f in SLIDERS:
        w = controls[f]
        opts = tuple(offered(f, cfg, model, engines))
        # only when they differ: new options cost a message to the browser and reset the value
        if tuple(w.options) != opts:
            value = w.value
            with w.hold_sync():
                w.options = opts
                w.value = value
