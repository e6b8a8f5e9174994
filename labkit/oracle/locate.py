"""Where a run first left the one-process reference: the module, the direction, the ranks and the rows.

`Lab.run(cfg, ..., locate=True)` records on every rank its first step's module outputs and the gradients
that flowed into them (engines/locate.py); `locate(result, ref)` runs the reference's first step on one
process with the same hooks, maps every rank's piece of every record onto the reference's tensor by the
layout, and walks the records in execution order (forward in the order the modules ran, then backward in
the order the gradients arrived). The first record a piece of which is beyond its bound is where the run
went wrong: every record before it matched, its inputs among them. A layout puts a record's pieces:

  data ranks (dp)  each its rows of the global batch (engines/train.py `data_index`), each microbatch its
                   rows of those (engines/data.py); a rank's loss is its rows' mean, so its gradients are
                   dp times the reference's (compared divided by dp)
  tp               a column-parallel output (wq, wk, wv, fc1, gate, up, the head's logits) split on its
                   last dim; a row-parallel output, after its all-reduce, whole on every tp rank, as every
                   norm's, block's and the embedding's (labkit/layout/tensor.py `tp_styles`)
  sp               those whole ones split along the sequence instead (the reduce-scatter's chunks)
  cp               the sequence's 2cp chunks, chunks r and 2cp-1-r on cp rank r (the zigzag: `zigzag`), every
                   kind alike (ring, all-gather, Ulysses, hierarchical); a rank's loss is its tokens' mean,
                   so its gradients are dp·cp times the reference's
  ep               an MoE layer's output back on the rank whose rows it is (the combine), whole: a data
                   rank as dp's; its experts inside are not recorded, the router's balance loss is per
                   sequence (engines/moe.py), so any split of the batch holds the reference's
  pp               each stage's modules on its ranks, under their full names

A padded vocabulary's logits beyond `vocab` must be the mask's -inf, and their gradient zero. Where every
record matched, the bug is outside any module: the phase is named from the oracle's own first mismatch
(labkit/oracle/checks.py): the gradients' reduction, the clip, the update. Each piece's error is relative
to its floored scale; the bound is fp32's 1e-5, or one bf16 rounding where the reference shares a bf16
layout's arithmetic (labkit/oracle/arithmetic.py: each record then the run's to the bit); DERIVATIONS.md,
"Locating a divergence".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from labkit.config.choices import numerics
from labkit.layout.tensor import tp_styles
from labkit.oracle.arithmetic import arithmetic, twin
from labkit.oracle.bounds import FP32, UNIT_ROUNDOFF
from labkit.oracle.checks import mismatches

LIMIT_BYTES = 2**28
"""What locate=True may record per rank (256 MiB, forward and backward): small models only."""


def locate_bytes(cfg, model) -> int:
    """Bytes a rank's records hold (fp32, forward and backward), at most: every recorded module's output
    over the rank's rows of the batch, its full width or its tp slice (engines/locate.py `RECORDED`)."""
    t = cfg.tp
    q, kv = model.heads * model.head_dim, model.n_kv_heads * model.head_dim
    # ln1, wo, attn, ln2, fc2 (down), mlp, the block's output (and Gemma's two post-norms): h wide each
    per_layer = (7 + (2 if model.family.sandwich_norm else 0)) * model.hidden + (q + 2 * kv) // t
    per_layer += (2 if model.family.gated_mlp else 1) * model.ffn // t  # fc1 (gate and up)
    per_layer += 2 * model.hidden + q // t + model.ffn // t  # the inputs of wq, fc1 (gate), wo, fc2 (down)
    width = model.layers * per_layer + 2 * model.hidden + model.padded_vocab(t) // t  # embed, head.norm, logits
    return 2 * 4 * width * model.seq * cfg.global_batch // (cfg.dp * cfg.ep * cfg.cp)


def locate_problems(cfg, model, locate) -> list[str]:
    """What locate=True cannot locate yet, each with the fix (Lab.run raises them as a ConfigError)."""
    if not isinstance(locate, bool):
        return [f"locate={locate!r} must be True or False"]
    if not locate:
        return []
    out = []
    kind = cfg.numerics
    if kind.fp8 or (kind.mixed and twin(cfg) is not None):
        where = "" if kind.fp8 else " under a layout whose arithmetic is not one process's (tp, cp, compile)"
        out.append(
            f"locate=True in {cfg.precision}{where}: bounds per activation are derived for fp32 and for bf16 "
            "layouts that split only the batch; "
            "locate the same layout in fp32 (precision='fp32'), which holds its logic at 1e-5"
        )
    if cfg.torch_impl and (cfg.tp > 1 or cfg.pp > 1):
        out.append(
            "locate=True with DTensor's TP or torch.distributed.pipelining (impl='torch', tp or pp > 1) is not yet "
            "built (DTensor's placements; pipelining's own forwards, its shapes inferred); locate impl='lab'"
        )
    if cfg.compile:
        out.append("locate=True with compiled blocks: hooks inside a compiled block are not run; compile=False")
    size = locate_bytes(cfg, model)
    if size > LIMIT_BYTES:
        out.append(
            f"locate=True would record {size / 2**20:.0f} MiB per rank, over its {LIMIT_BYTES // 2**20} MiB: "
            "small models only; fewer layers, a smaller hidden, seq or global_batch"
        )
    return out


@dataclass(frozen=True)
class Point:
    """One record (a module's output, or the gradient into it) where some rank's piece is beyond its bound."""

    module: str
    """The module's name in the full model, e.g. 'blocks.1.attn.wo'."""
    direction: str
    """'forward' (its output) or 'backward' (the gradient that flowed into its output)."""
    where: str
    """The failing ranks (their mesh coordinates) and the rows / columns that differ, e.g. 'tp rank 1,
    columns 125-127'."""
    error: float
    """The worst failing piece's ||run - reference|| over its floored scale (inf: the padding not masked)."""
    bound: float
    note: str = ""

    def __str__(self) -> str:
        which = "input" if self.module.endswith(".input") else "output"
        what = f"forward {which}" if self.direction == "forward" else f"backward, the gradient into its {which}"
        tail = f" ({self.note})" if self.note else ""
        # an input's record follows the output it was made from: the op between the two is at fault
        before = "its inputs matched" if which == "output" else "what it was made from matched"
        return (
            f"{module_words(self.module.removesuffix('.input'))} {what}, {self.where}: {self.error:.2g} over a "
            f"bound of {self.bound:.2g}{tail}; {before}"
        )


@dataclass(frozen=True)
class Located:
    """Where a run first went wrong: a record (`point`), or, every record matching, a phase."""

    point: Point | None
    phase: str = ""
    """Where no record differs: 'the gradients' reduction', 'the clip', 'the update', ..."""
    mismatch: str = ""
    """The oracle's first mismatch of that phase (checks.Mismatch as text)."""

    def __str__(self) -> str:
        if self.point is not None:
            return str(self.point)
        return f"{self.phase}, after every module's forward and backward matched at step 0: {self.mismatch}"


def module_words(name: str) -> str:
    """'blocks.1.attn.wo' -> 'block 1, attn.wo'; 'head.proj' -> 'head.proj (the logits)'."""
    m = re.fullmatch(r"blocks\.(\d+)(?:\.(.+))?", name)
    if m:
        return f"block {m[1]}" + (f", {m[2]}" if m[2] else "")
    return "head.proj (the logits)" if name == "head.proj" else name


def placement(name: str, direction: str, styles: dict, sp: bool) -> str | None:
    """How tp puts a record of module `name`: 'cols' (its last dim split), 'seq' (its sequence split, SP),
    'whole' (every tp rank holds it all), or None (not compared: a KV head shared by several tp ranks).
    A linear's input (`<name>.input`): a row-parallel one's is split as its weight's columns, a
    column-parallel one's is whole (SP's all-gather before it); the gradient into the latter is each tp
    rank's partial sum, not compared (f's backward sums it into the norm's output gradient, recorded)."""
    if name.endswith(".input"):
        style = styles.get(name.removesuffix(".input"), {}).get("style")
        if style == "colwise" and direction == "backward":
            return None
        return "cols" if style == "rowwise" else "whole"
    style = styles.get(name, {})
    if "kv_groups" in style:
        return None
    if style.get("style") == "colwise" or name == "head.proj":
        return "cols"
    return "seq" if sp else "whole"


def reference_records(result, ref) -> dict:
    """The reference's first step on one process, recorded with the run's hooks, in the run's reference
    arithmetic (labkit/oracle/arithmetic.py): fp32 on the whole global batch; bf16 where the layout splits
    only the batch, split as the layout splits it, each part's records the run's to the bit."""
    # torch where the reference runs, not when the oracle is imported
    import torch

    from labkit.engines import data as batches
    from labkit.engines.locate import Recorder
    from labkit.engines.model import build_model
    from labkit.engines.precision import compute_copy

    arith = arithmetic(result)
    if numerics(arith.precision).mixed and not arith.shared:
        raise ValueError(f"locate holds {arith.precision} only where its arithmetic is one process's: {arith.why}")
    seed = result.seed if ref.seed is None else ref.seed
    batch = result.config.global_batch if ref.global_batch is None else ref.global_batch
    compute = compute_copy(build_model(ref.model, seed), arith.precision)
    recorder = Recorder([compute.module])
    tokens, targets = batches.batch(ref.data, 0, seed, batch, ref.model)
    before = torch.get_num_threads()
    torch.set_num_threads(arith.threads or before)
    try:
        for i in range(arith.shards):  # each part's loss divided by its rank's microbatches, as the run's
            part = compute.module(batches.shard(tokens, i, arith.shards), batches.shard(targets, i, arith.shards))
            (part / arith.microbatches).backward()
            compute.zero_grads()
    finally:
        torch.set_num_threads(before)
    bound = UNIT_ROUNDOFF["bf16"] if numerics(arith.precision).mixed else FP32.grads
    return {**recorder.finish(), "shards": arith.shards, "microbatches": arith.microbatches, "bound": bound}


def locate(result, ref, own: dict | None = None) -> Located | None:
    """Where `result` (run with locate=True) first left `ref`'s one-process training; None where it did not
    (every record within its bound and the oracle finds nothing). `own`: the reference's records
    (`reference_records`), computed here where not given."""
    if result.activations is None:
        raise ValueError("the run recorded nothing to locate with: run it with Lab.run(..., locate=True)")
    point = first_divergence(result, own or reference_records(result, ref))
    if point is not None:
        return Located(point)
    found = mismatches(result, ref)
    return phase(found)


PHASES = (
    ("a value not finite", lambda m: m.check == "finite"),
    ("the gradients' reduction", lambda m: m.check == "gradients" or m.message.startswith("gradients ")),
    ("the clip (the gradient norm)", lambda m: m.check == "grad norms"),
    ("the update", lambda m: m.check in ("parameters", "replicas", "working weights", "buffers", "padding")),
    ("the loss", lambda m: m.check == "losses"),
)
"""The phases after the modules' forward and backward, in the order a step runs them; a mismatch belongs
to the first whose test it passes (a replica's gradients that differ are the reduction's)."""


def named_step(message: str) -> int | None:
    """The first step a mismatch's message names ('step 1', 'step(s) [1]'), or None."""
    m = re.search(r"step(?:\(s\))? \[?(\d+)", message)
    return int(m[1]) if m else None


def phase(found: list) -> Located | None:
    """The earliest phase that any of the oracle's mismatches `found` belongs to, at the first step any
    names (None: nothing found). A message naming no step (the final parameters) takes the first step its
    check names elsewhere, else step 0. A later step's is named as that step alone: locate records step 0."""
    if not found:
        return None
    named: dict[str, int] = {}  # each check's first named step
    for m in found:
        if (n := named_step(m.message)) is not None:
            named[m.check] = min(named.get(m.check, n), n)
    step = {id(m): n if (n := named_step(m.message)) is not None else named.get(m.check, 0) for m in found}
    first = min(step.values(), default=None)
    for name, test in PHASES:
        # the reduced gradient against the reference's says more than two ranks' copies that differ
        hits = sorted((m for m in found if test(m) and step[id(m)] == first), key=lambda m: m.check != "gradients")
        if hits:
            return Located(None, name if first == 0 else f"step {first} (locate records step 0 alone)", str(hits[0]))
    return Located(None, f"the {found[0].check} check", str(found[0]))  # none of a step's (float8, routing)


def margin(result, own: dict) -> float:
    """The worst piece's error over its bound, every record of a run that locates nothing (< 1)."""
    return max((r["ratio"] for r in ratios(result, own)), key=lambda e: np.inf if np.isnan(e) else e)


def ratios(result, own: dict) -> list[dict]:
    """Every record compared, in execution order: {module, direction, ratio (its worst piece's error over the
    bound; inf: a hole or the padding unmasked), failed}: what widgets/locate_figure.py draws."""
    out = []
    for (name, direction), point, errs in compared(result, own):
        worst = max(errs, key=lambda e: np.inf if np.isnan(e) else e, default=0.0)
        if point is not None and point.error == np.inf:  # a hole has no piece's error to say it
            worst = np.inf
        out.append({"module": name, "direction": direction, "ratio": worst / own["bound"], "failed": point is not None})
    return out


def first_divergence(result, own: dict) -> Point | None:
    """The first record, in the reference's execution order, one of whose pieces is beyond its bound."""
    return next((point for _, point, _ in compared(result, own) if point is not None), None)


def compared(result, own: dict):
    """(record, its Point or None, every piece's error) for each record compared, in execution order."""
    cfg, model = result.config, result.model
    styles = tp_styles(model, cfg.sequence_parallel, cfg.tp) if cfg.tp > 1 else {}
    parts: dict[tuple[str, str], list] = {}  # the reference's parts of the batch, in order
    for r in sorted(own["records"], key=lambda r: r["microbatch"]):
        parts.setdefault((r["name"], r["direction"]), []).append(r["values"])
    mine = {key: np.concatenate(v) for key, v in parts.items()}
    # a rank's loss is its tokens' mean, each part's the reference's: its gradients are dp·cp / parts times theirs
    factor = cfg.dp * cfg.ep * cfg.cp * own["microbatches"] / own["shards"]
    pieces: dict[tuple[str, str], list] = {}
    for rank in result.activations:
        for r in rank["records"]:
            pieces.setdefault((r["name"], r["direction"]), []).append((rank["coords"], r["microbatch"], r["values"]))
    for key in map(tuple, own["order"]):
        how = placement(*key, styles, cfg.sequence_parallel and cfg.tp > 1)
        if how is not None:
            errs: list[float] = []
            yield key, compare(key, mine[key], pieces.get(key, []), how, cfg, (own["bound"], factor), errs), errs


def compare(key, ref: np.ndarray, pieces: list, how: str, cfg, held: tuple, seen: list | None = None) -> Point | None:
    """Every rank's piece of one record against the reference's `ref` (B, s, F): a Point where any piece
    is beyond the bound, or some element of `ref` is in no rank's piece. `held`: (the bound, what the run's
    gradients are times the reference's)."""
    name, direction = key
    (bound, factor), total = held, float(np.linalg.norm(ref.astype(np.float64)))
    data_ranks = cfg.dp * cfg.ep
    rows = ref.shape[0] // data_ranks // cfg.microbatches  # a microbatch's rows of the global batch
    covered = np.zeros(ref.shape[:2] + (max(ref.shape[-1], 1),), dtype=bool)
    failing = []
    for coords, mb, values in pieces:
        d = coords["dp"] * cfg.ep + coords["ep"]
        b0 = (d * cfg.microbatches + mb) * rows
        positions = zigzag(ref.shape[1], cfg.cp, coords["cp"])  # this cp rank's, in its local order
        if how == "seq":  # SP: the tp rank's chunk of them
            positions = positions.reshape(cfg.tp, -1)[coords["tp"]]
        c0 = coords["tp"] * values.shape[-1] if how == "cols" else 0
        box = (slice(b0, b0 + values.shape[0]), positions, slice(c0, c0 + values.shape[-1]))
        run = values.astype(np.float64) / (factor if direction == "backward" else 1)
        real = max(0, min(box[2].stop, ref.shape[-1]) - c0)  # columns that are tokens (the rest: padding)
        want = ref[box[0], box[1], c0 : c0 + real].astype(np.float64)
        covered[box[0], box[1], c0 : c0 + real] = True
        diff = np.abs(run[..., :real] - want)
        scale = max(float(np.linalg.norm(want)), total * (want.size / max(ref.size, 1)) ** 0.5)
        err = float(np.linalg.norm(run[..., :real] - want)) / scale if scale else (0.0 if not diff.any() else np.inf)
        bad = ~(diff <= bound * scale / max(want.size, 1) ** 0.5)
        note = ""
        if real < run.shape[-1]:  # a padded vocabulary's columns: -inf forward (the mask), 0 backward
            pad = run[..., real:]
            wrong = ~(pad == -np.inf) if direction == "forward" else ~(pad == 0)
            bad = np.concatenate([bad, wrong], axis=-1)
            if wrong.any():
                err = np.inf
                note = f"the padding's logits are {np.nanmax(pad[wrong]):.3g}, not the mask's -inf"
                if direction == "backward":
                    note = f"the padding's gradient is {np.nanmax(np.abs(pad)):.3g}, not zero"
        if seen is not None:
            seen.append(err)
        if not err <= bound:
            axes = (np.arange(b0, b0 + values.shape[0]), positions, np.arange(c0, c0 + values.shape[-1]))
            failing.append((coords, mb, err, region(bad, axes), note))
    if not covered.all():
        b, s, c = (np.flatnonzero((~covered).any(axis=tuple(i for i in range(3) if i != ax))) for ax in range(3))
        hole = f"batch rows {spans(b)}, sequence rows {spans(s)}, columns {spans(c)}"
        return Point(name, direction, f"{hole} computed on no rank", np.inf, bound, "a piece no rank recorded")
    if not failing:
        return None
    groups: dict[tuple[str, str], list] = {}
    for coords, mb, err, where, note in failing:
        groups.setdefault((where, note), []).append((coords, mb, err))
    parts = [
        ranks_words([c for c, _, _ in g], [mb for _, mb, _ in g], cfg) + (f", {w}" if w else "")
        for (w, _), g in groups.items()
    ]
    worst = max((e for _, _, e, _, _ in failing), key=lambda e: np.inf if np.isnan(e) else e)
    note = next((n for _, _, _, _, n in failing if n), "")
    return Point(name, direction, "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else ""), worst, bound, note)


def region(bad: np.ndarray, axes: tuple) -> str:
    """The rows and columns of a piece where its elements differ, in the reference's coordinates (`axes`:
    each dim's indices there); a dim where every index of the piece differs is left out."""
    words = ("batch rows", "sequence rows", "columns")
    out = []
    for ax, word in enumerate(words):
        hit = np.flatnonzero(bad.any(axis=tuple(i for i in range(bad.ndim) if i != ax)))
        if 0 < hit.size < bad.shape[ax]:
            out.append(f"{word} {spans(np.sort(axes[ax][hit]))}")
    return ", ".join(out)


def zigzag(seq: int, cp: int, rank: int) -> np.ndarray:
    """The sequence positions cp rank `rank` holds, in its local order: chunks rank and 2cp-1-rank of 2cp
    (engines/parallel/context/ `zigzag_index`, which the ranks' inputs are cut by); every position at cp=1."""
    if cp == 1:
        return np.arange(seq)
    c = seq // (2 * cp)
    return np.concatenate([np.arange(k * c, (k + 1) * c) for k in (rank, 2 * cp - 1 - rank)])


def spans(idx: np.ndarray, most: int = 3) -> str:
    """Sorted indices as runs: [8..15, 20] -> '8-15, 20'."""
    idx = np.asarray(idx)
    if idx.size == 0:
        return "none"
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    runs = [(int(r[0]), int(r[-1])) for r in np.split(idx, cuts)]
    text = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:most]]
    return ", ".join(text) + (", ..." if len(runs) > most else "")


def ranks_words(coords: list[dict], mbs: list[int], cfg) -> str:
    """The mesh coordinates of failing pieces, dims of size > 1 alone: 'tp rank 1, dp ranks 0-1'."""
    out = []
    for dim in ("tp", "cp", "ep", "dp", "pp"):
        if getattr(cfg, dim) > 1:
            vals = np.array(sorted({c[dim] for c in coords}))
            out.append(f"{dim} rank{'s' if vals.size > 1 else ''} {spans(vals)}")
    if cfg.microbatches > 1:
        vals = np.array(sorted(set(mbs)))
        out.append(f"microbatch{'es' if vals.size > 1 else ''} {spans(vals)}")
    return ", ".join(out) or "rank 0"
