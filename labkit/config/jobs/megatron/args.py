"""Megatron-LM's launch read as words (labkit/config/jobs/megatron/; shell/ evaluates a script into
them): torchrun's flags apart from the training script's, the arguments taken one by one (the rest
become Job.notes), and the pipeline split of core_v0.14.0 (--pipeline-model-parallel-layout, the
virtual stages, --account-for-embedding/loss-in-pipeline-split, --decoder-first/last-pipeline-num-layers)."""

from __future__ import annotations

import re

from labkit.config.choices import ConfigError

FLAGS = {
    "sequence-parallel",
    "use-distributed-optimizer",
    "swiglu",
    "group-query-attention",
    "bf16",
    "fp16",
    "untie-embeddings-and-output-weights",
    "disable-bias-linear",
    "add-qkv-bias",
    "use-rope-scaling",
    "account-for-embedding-in-pipeline-split",
    "account-for-loss-in-pipeline-split",
    "recompute-activations",
    "use-megatron-fsdp",
    "use-custom-fsdp",
    "use-tp-pp-dp-mapping",
    "multi-latent-attention",
    "qk-layernorm",
    "moe-router-pre-softmax",
    "moe-router-enable-expert-bias",
    "moe-shared-expert-gate",
    "apply-layernorm-1p",
    "no-position-embedding",
}
"""Arguments that take no value (store_true / store_false)."""


def parse(words: list[str]) -> tuple[dict, dict]:
    """(launcher args, Megatron args): name -> value (a string, a list for several, None for a
    flag); the launcher's are those before the script (the first word ending in .py)."""
    # torchrun's own flags come before the training script; Megatron's after it
    script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    launcher, args = {}, {}
    for part, out in (
        (words[:script] if script is not None else [], launcher),
        (words[script + 1 :] if script is not None else words, args),
    ):
        name = None
        for w in part:
            if w.startswith("--"):
                # --name=value and --name value are the same to argparse
                name, eq, value = w[2:].partition("=")
                out[name] = value if eq else None
            elif name is not None and name not in FLAGS:
                # nargs='*' arguments (--recompute-modules core_attn mlp) collect every word up to the next flag
                prev = out[name]
                out[name] = w if prev is None else ([*prev, w] if isinstance(prev, list) else [prev, w])
    return launcher, args


class Args:
    """Megatron's arguments, taken one by one; the ones never taken are Job.notes."""

    def __init__(self, args: dict):
        self.args, self.taken = args, set()

    def flag(self, name: str) -> bool:
        self.taken.add(name)
        return name in self.args

    def get(self, name: str, kind=str, default=None):
        self.taken.add(name)
        if name not in self.args:
            return default
        v = self.args[name]
        if kind is list:  # nargs: one word or several read the same
            return v if isinstance(v, list) else [] if v is None else [v]
        if not isinstance(v, str):
            raise ConfigError([f"--{name} {v!r}: expected one value"])
        try:
            return kind(v)
        except ValueError:
            raise ConfigError([f"--{name} {v!r} is not a {kind.__name__}"]) from None

    def rest(self) -> list[str]:
        return [
            f"--{k}"
            + ("" if v is None else f" {' '.join(v) if isinstance(v, list) else v}")
            + ": not represented (labkit's layout and estimate do not use it)"
            for k, v in self.args.items()
            if k not in self.taken
        ]


def layout_string(text: str, pp: int, layers: int) -> tuple[int, tuple[int, ...]]:
    """--pipeline-model-parallel-layout ('E|(t|)*3,m|m||L'): (virtual stages, blocks per stage)."""
    s = text.replace(",", "").replace(" ", "")
    while True:  # expand the innermost repetitions, (group)*n and x*n
        new = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
        new = re.sub(r"([EtLm])\*(\d+)", lambda m: m.group(1) * int(m.group(2)), new)
        if new == s:
            break
        s = new
    # "|" separates stages in virtual order: stage i sits on pipeline rank i % pp, as chunk i // pp
    stages = s.split("|")
    if set(s) - set("EtLm|") or "m" in s:
        raise ConfigError(
            [
                f"--pipeline-model-parallel-layout {text!r}: labkit reads E, t, L and |; MTP layers (m) "
                "and other symbols are not built"
            ]
        )
    if len(stages) % pp or "E" not in stages[0] or "L" not in stages[-1]:
        raise ConfigError(
            [
                f"--pipeline-model-parallel-layout {text!r} has {len(stages)} stages (a multiple of "
                f"--pipeline-model-parallel-size {pp} needed), the embedding E first and the loss L last"
            ]
        )
    # Megatron asserts the same: the layout places every decoder layer once
    if s.count("t") != layers:
        raise ConfigError(
            [
                f"--pipeline-model-parallel-layout {text!r} has {s.count('t')} transformer layers; "
                f"--num-layers is {layers}"
            ]
        )
    return len(stages) // pp, tuple(st.count("t") for st in stages)


def stages_of(a: Args, layers: int, pp: int) -> tuple[int, tuple[int, ...]]:
    """(virtual stages per rank, blocks of each virtual stage or ()) as Megatron splits the layers."""
    layout = a.get("pipeline-model-parallel-layout")
    e, l_ = a.flag("account-for-embedding-in-pipeline-split"), a.flag("account-for-loss-in-pipeline-split")
    per = a.get("num-layers-per-virtual-pipeline-stage", int)
    vp = a.get("num-virtual-stages-per-pipeline-rank", int)
    first, last = a.get("decoder-first-pipeline-num-layers", int), a.get("decoder-last-pipeline-num-layers", int)
    if layout:  # the layout string, when given, decides alone (Megatron ignores the other split arguments)
        return layout_string(layout, pp, layers)
    total = layers + e + l_  # the embedding and the loss as one layer each, where the split counts them
    if per is not None:
        if total % (pp * per):
            raise ConfigError(
                [
                    f"--num-layers-per-virtual-pipeline-stage {per} does not divide --num-layers {layers}"
                    f"{' (+1 embedding, +1 loss)' if e or l_ else ''} over --pipeline-model-parallel-size {pp}"
                ]
            )
        vp = total // (pp * per)
    vp = vp or 1  # neither given: one model chunk per pipeline rank
    if first is not None or last is not None:
        if vp > 1 or e or l_:
            raise ConfigError(
                [
                    "--decoder-first/last-pipeline-num-layers with virtual stages or account-for-* "
                    "splits: labkit reads them on plain stages only; write --pipeline-model-parallel-layout"
                ]
            )
        rest, mid = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if mid < 1 or rest % mid:
            raise ConfigError(
                [
                    f"--decoder-first-pipeline-num-layers {first} / --decoder-last-pipeline-num-layers "
                    f"{last} leave {rest} layers that do not split over the other {mid} stages"
                ]
            )
        # the stages neither argument names share the rest evenly (Megatron's transformer_layer.py)
        even = [rest // mid] * mid
        return 1, tuple(([first] if first is not None else []) + even + ([last] if last is not None else []))
    chunks = pp * vp
    if total % chunks:
        raise ConfigError(
            [
                f"--num-layers {layers}{' + embedding + loss' if e or l_ else ''} = {total} does not split "
                f"evenly over --pipeline-model-parallel-size {pp} x {vp} virtual stages"
            ]
        )
    sizes = [total // chunks] * chunks
    sizes[0] -= e  # the embedding takes one block's place in the first chunk
    sizes[-1] -= l_  # the loss (the head) one in the last
    # an even split is labkit's default (stage_layers empty): said only when the ends differ
    return vp, tuple(sizes) if e or l_ else ()
