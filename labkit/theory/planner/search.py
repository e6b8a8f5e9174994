"""The planner's search: every layout of a model on a number of GPUs, pruned by memory before it
is timed, ranked by predicted tokens/s/GPU (theory/planner/evaluate.py prices one layout).

What is enumerated, and what is left out because another choice dominates it (same time, less
memory, or the same memory in less time, in this model):
  mesh          tp (powers of two within a node, dividing heads), cp (2·cp | seq), ep (| experts),
                pp (| the GPUs left; uneven stages when the layers do not split), dp the rest
  cp kind       with cp > 1, each of ring, Ulysses (where the heads divide by cp) and hierarchical with
                each proper divisor of cp whose run fits a node; the all-gather is dominated by the
                ring (its bytes, none hidden, more memory: candidates.SEARCHED_KINDS)
  batch         the microbatch size b (a divisor of the sequences per data rank), m = the rest
  pipeline      1F1B, interleaved with v = 2, 4 (m a multiple of pp, as Megatron needs); GPipe is
                left out (1F1B's bubble with more activations in flight)
  sharding      none, ZeRO-1, ZeRO-2, FSDP (ZeRO-3 is FSDP's traffic); under pp none, ZeRO-1, FSDP;
                each sharded one also as HSDP, a shard group filling a node, replicated across nodes
  SP            always on with tp: the same bytes on the wire as TP's all-reduces, less memory
                (Korthikanti et al. 2022, section 4.2.2)
  checkpointing none, selective, op, full in that order of recomputation: the first that fits is
                the one timed (recomputation only adds time; memory only falls down the list)
  precision     bf16, and fp8 where the hardware has it (or the one asked for)
A tight plan (it fits only once the allocator gives back its cache) comes after every plan that
fits with the allocator's reserve: its predicted time leaves out the allocator's retries (a
cudaFree and a device synchronisation each), which this model does not price.
`fixed` keeps any of FIXABLE as given (a node's tp, a framework's sharding or schedule) and
searches the rest; a fixed schedule other than 1F1B and interleaved is searched too.

Pruned, and counted with their reason: microbatch sizes are tried in ascending order, each from the
lightest checkpointing that fit the one before (memory grows with the microbatch), and stop at the
first that does not fit even with full checkpointing; a layout whose compute alone (its slowest
rank's blocks, stretched by the bubble: timing.compute_floor) is slower than the slowest of the
best `top` so far is not timed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache

from labkit.config import ConfigError, ModelConfig, ParallelConfig
from labkit.config.choices import SHARDINGS, Precision, Sharded, pipeline_shape, recomputation, sharded
from labkit.theory.planner.candidates import hybrids, with_kinds
from labkit.theory.planner.evaluate import Plan, _evaluate, _over, fullest_required, layout_problems
from labkit.theory.planner.hardware import Hardware, hardware_of
from labkit.theory.planner.stacks import with_stack
from labkit.theory.planner.timing import compute_floor

TRIED_CHECKPOINTING = (False, "selective", "op", True)
"""The checkpoint_activations values the search tries (labkit.config.CHECKPOINTING less 'full', which
is True), in order of recomputation (time added) and of memory kept (falling)."""
SEARCHED_PRECISIONS = ("bf16", "fp8")
"""The precisions the planner prices (the ones hardware.py keeps rates for; fp32 is evaluate's only)."""
NEAREST = 20
"""Layouts that do not fit kept in `.rejected`, the nearest misses first."""
FIXABLE = ("dp", "tp", "pp", "cp", "ep", "sharding", "schedule", "virtual_stages", "microbatches")
FIXABLE += ("checkpoint_activations", "sequence_parallel", "cp_kind", "cp_a2a", "dp_replicate")
"""The layout fields `plan(fixed=...)` can hold."""


@dataclass
class Rejected:
    config: ParallelConfig
    reason: str


class Plans(list):
    """The best layouts, fastest first (a list of Plan), with what was left out:
    `.rejected` (the nearest misses, each with its reason), `.counts` (reason -> layouts),
    `.considered` (layouts priced for memory) and `.timed` (layouts that fit and were timed; the
    others that fit were slower than the best on their compute alone)."""

    def __init__(self, plans, rejected, counts, considered: int, timed: int, gpus: int = 0):
        super().__init__(plans)
        self.rejected: list[Rejected] = rejected
        self.counts: dict[str, int] = counts
        self.considered, self.timed = considered, timed
        self.gpus = gpus
        self.assumptions: tuple[str, ...] = ()
        """The constants behind the prices with neither a measurement nor a datasheet (plan sets them)."""

    @property
    def why(self) -> str:
        """Why the list is empty, from the reasons counted ('' when it is not): never an empty
        answer without one."""
        if self:
            return ""
        if not self.counts:
            return (
                f"no mesh of {self.gpus:,} GPUs is one the model allows (tp must divide the heads, 2·cp the sequence)"
            )
        top3 = sorted(self.counts.items(), key=lambda x: -x[1])[:3]
        reasons = [reason + (f" ({n:,} layouts)" if n > 1 else "") for reason, n in top3]
        return "no layout fits or is valid: " + "; ".join(reasons)


def searched(sh: Sharded, pp: int) -> bool:
    """Whether the search tries a sharding (every value of SHARDINGS is decided here: a new one is searched
    unless a rule below says why not). Stage 3 is tried in FSDP's units only: ZeRO-3's per-module units hold
    the same states, and FSDP's per-block gathers are what the published runs use. Under a pipeline ZeRO-2
    keeps every bucket's gradients from the first microbatch to the last (DERIVATIONS.md, "FSDP and ZeRO-2/3
    under pipeline parallelism"): ZeRO-1's memory and traffic, the same plan as ZeRO-1's."""
    if sh.params:
        return sh.fsdp
    return not (sh.grads and pp > 1)


def _pow2(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return list(_divisors_cached(n, limit))


@lru_cache(maxsize=1024)
def _divisors_cached(n: int, limit: int | None) -> tuple[int, ...]:
    return tuple(d for d in range(1, (limit or n) + 1) if n % d == 0)


@lru_cache(maxsize=1024)  # the search asks it of every mesh: ~13,000 times for the same few (layers, pp)
def stage_split(layers: int, stages: int) -> tuple[int, ...]:
    """Uneven stages as Llama 3 lays them out (Llama Team 2024, section 3.3.2: one layer fewer on
    the first and the last stage, which hold the embedding and the head): the remainder of
    layers / stages goes to the middle stages first."""
    q, r = divmod(layers, stages)
    if r == 0:
        return ()
    sizes = [q] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(r):
        sizes[middle[i % len(middle)]] += 1
    return tuple(sizes)


@dataclass
class _Tally:
    counts: dict[str, int] = field(default_factory=dict)
    misses: list[tuple[float, Rejected]] = field(default_factory=list)

    def invalid(self, reason: str, n: int = 1) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + n

    def too_big(self, cfg: ParallelConfig, peak: float, hw: Hardware) -> None:
        self.invalid("does not fit in memory even with full checkpointing")
        self.misses.append((peak, Rejected(cfg, f"does not fit: {_over(peak, hw)}")))


def meshes(model: ModelConfig, gpus: int, hw: Hardware, fixed: dict | None = None):
    """(tp, cp, ep, pp, dp) whose product is `gpus` and whose degrees the model allows (a degree
    in `fixed` is the only one tried; the layout's checks judge it)."""
    fixed = fixed or {}
    # tp stays within a node: its all-reduces are on every layer's critical path, on NVLink there and on the
    # NICs beyond (DERIVATIONS.md, "The time model"); it must split the heads. zigzag CP cuts the sequence
    # into 2·cp chunks, two per rank (DERIVATIONS.md, "Context parallelism"); ep must split the experts
    tps = [fixed["tp"]] if "tp" in fixed else [t for t in _pow2(hw.gpus_per_node) if model.heads % t == 0]
    cps = [fixed["cp"]] if "cp" in fixed else [c for c in _pow2(32) if model.seq % (2 * c) == 0]
    eps = [fixed["ep"]] if "ep" in fixed else [e for e in _divisors(model.experts, 64)] if model.experts else [1]
    for tp in tps:
        for cp in cps:
            for ep in eps:
                # the degrees must use every GPU: a remainder would leave some idle
                rest, left = gpus // (tp * cp * ep), gpus % (tp * cp * ep)
                if left:
                    continue
                # no more stages than blocks; whether they split evenly or as Llama 3's uneven stages is judged later
                pps = [fixed["pp"]] if "pp" in fixed else _divisors(rest, min(rest, model.layers))
                for pp in pps:
                    # dp takes what is left: a fixed dp admits only the pp that leaves exactly it
                    if rest % pp == 0 and fixed.get("dp", rest // pp) == rest // pp:
                        yield tp, cp, ep, pp, rest // pp


def _layout(mesh, m: int, v: int, sharding: str, precision: str, model, tally, schedule: str | None = None):
    """The layout of `mesh` with m microbatches, v chunks per pipeline rank (interleaved when
    v > 1 unless `schedule` says, uneven stages where the layers do not split), or None with the
    reason tallied."""
    pp = mesh.pp
    # Megatron's interleaved schedule runs microbatches in rounds of pp per chunk, and a virtual stage
    # without a block would be a chunk with nothing to compute
    if v > 1 and (m % pp or model.layers < pp * v):
        tally.invalid("interleaved needs microbatches a multiple of pp and a layer per virtual stage")
        return None
    # Llama 3's uneven stages only where the layers do not divide by the stages (else stage_split gives ())
    split = stage_split(model.layers, pp * v) if pp > 1 else ()
    schedule = schedule or ("interleaved" if v > 1 else "1f1b")
    # one replace: a config's construction checks every field, and the search builds tens of thousands
    return mesh.replace(
        microbatches=m, schedule=schedule, virtual_stages=v, sharding=sharding, precision=precision, stage_layers=split
    )


def _checked(fixed: dict | None) -> dict:
    """`fixed` with its checkpointing spelled as TRIED_CHECKPOINTING does, or ConfigError naming the
    fields the search cannot hold, or a held value ParallelConfig refuses (its field checks name the
    allowed values: a sharding or schedule not in the list, tp='abc', dp=0)."""
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(FIXABLE))
    if unknown:
        raise ConfigError([f"fixed={unknown} cannot be held by the planner; it holds {', '.join(FIXABLE)}"])
    # each held value judged alone, as ParallelConfig judges its fields (the combinations are the search's)
    ParallelConfig(**fixed)
    if "checkpoint_activations" in fixed:
        ac = fixed["checkpoint_activations"]
        r = recomputation(ac if isinstance(ac, str) else bool(ac))  # a name ('none', 'full', ...) or a value
        fixed["checkpoint_activations"] = r.mode if r.attention_only or r.per_op else r.recomputes
    return fixed


def _arguments(model, gpus, hw: Hardware, global_batch, top, precision) -> tuple[int, tuple[str, ...]]:
    """The global batch (its default where None) and the precisions to search, or ConfigError naming
    the argument, its value and a fix."""
    if not isinstance(model, ModelConfig):
        raise ConfigError([f"plan(model, gpus, ...) takes a ModelConfig first, not a {type(model).__name__}"])
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ConfigError([f"gpus={gpus!r} must be a positive integer"])
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ConfigError([f"top={top!r} must be a positive integer: how many layouts to return, e.g. top=10"])
    default = max(1, round(4 * 2**20 / model.seq))
    if global_batch is not None and (
        not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1
    ):
        raise ConfigError(
            [
                f"global_batch={global_batch!r} must be a positive integer (sequences per step); leave it out for "
                f"the default, {default:,} sequences (4M tokens)"
            ]
        )
    if precision is not None:
        if precision not in SEARCHED_PRECISIONS:
            raise ConfigError(
                [f"precision={precision!r}: the planner prices {' and '.join(SEARCHED_PRECISIONS)}; pick one of those"]
            )
        hw.peak(precision)  # fp8 on hardware without an fp8 rate: refused, naming the hardware
    precisions = (precision,) if precision else (("bf16", "fp8") if hw.fp8_flops else ("bf16",))
    return global_batch or default, precisions


def _held_degrees(fixed: dict, gpus: int) -> str:
    """Why no mesh of `gpus` can hold the fixed degrees ('' when one can): their product must divide
    the GPUs, and all five held must use them all."""
    held = {d: fixed[d] for d in ("dp", "tp", "pp", "cp", "ep") if d in fixed}
    product = 1
    for v in held.values():
        product *= v
    named = "·".join(f"{d}={v}" for d, v in held.items())
    if gpus % product:
        return f"{named} does not divide {gpus:,} GPUs"
    if len(held) == 5 and product != gpus:
        return f"{named} uses {product:,} of the {gpus:,} GPUs: the degrees' product must be the GPUs"
    return ""


def _chunks_per_rank(pp: int, fixed: dict) -> tuple[int, ...]:
    """The v to try: 1F1B and interleaved (2, 4) unless the schedule or v is fixed."""
    if pp == 1:
        return (1,)
    if "virtual_stages" in fixed:
        return (fixed["virtual_stages"],)
    schedule = fixed.get("schedule")
    if schedule is None:
        return (1, 2, 4)
    shape = pipeline_shape(schedule)
    return (2, 4) if shape.interleaved else (2,) if shape.v_shaped else (1,)


def plan(
    model: ModelConfig,
    gpus: int,
    hardware: str | Hardware = "h100",
    global_batch: int | None = None,
    top: int = 10,
    precision: Precision | None = None,
    fixed: dict | None = None,
    stack: str = "eager",
) -> Plans:
    """The `top` layouts of `model` on `gpus` GPUs that fit, fastest first (predicted
    tokens/s/GPU; tight ones after the rest). global_batch: sequences per step (default: 4M
    tokens, Llama 3's batch at 8k, rounded to sequences); precision: 'bf16' or 'fp8' (default:
    both where the hardware has fp8); fixed: layout fields held as given (FIXABLE), e.g.
    {"tp": 8} for tensor parallelism inside a node or {"sharding": "fsdp"} for a framework that
    has only FSDP; stack: the software stack the steps run on (stacks.STACKS, default 'eager').
    The list's `.rejected` and `.counts` say what was left out and why."""
    hw = with_stack(hardware_of(hardware), stack)  # how the step's kernels run (stacks.py), eager unless told
    gb, precisions = _arguments(model, gpus, hw, global_batch, top, precision)
    fixed = _checked(fixed)
    ckpts = (fixed["checkpoint_activations"],) if "checkpoint_activations" in fixed else TRIED_CHECKPOINTING
    tally, timed, floors = _Tally(), [], []  # floors: the best `top` step times so far (max-heap)
    considered = 0
    held = _held_degrees(fixed, gpus)
    if held:  # no mesh to try: the result says why
        tally.invalid(held)
    for tp, cp, ep, pp, dp, kind, a2a in with_kinds(() if held else meshes(model, gpus, hw, fixed), fixed, hw):
        # SP is on with tp unless held off: the same wire bytes as TP's all-reduces and less memory, so SP
        # off is dominated (Korthikanti et al. 2022, section 4.2.2)
        sp = fixed.get("sequence_parallel", tp > 1)
        mesh = ParallelConfig(
            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, global_batch=gb, sequence_parallel=sp, cp_kind=kind, cp_a2a=a2a
        )
        split = stage_split(model.layers, pp) if pp > 1 else ()
        # the degrees' arithmetic, on the uneven split a pipeline would take
        found = layout_problems(mesh.replace(global_batch=dp * ep, stage_layers=split), model)
        if found:
            # counted under the first violation, its fix (after ';') cut off
            tally.invalid(found[0].split(";")[0])
            continue
        # checked here, not by the degrees' check above, which was given a batch of dp·ep to judge them alone
        if gb % (dp * ep):
            tally.invalid("global_batch is not divisible by dp·ep")
            continue
        per = gb // (dp * ep)
        shardings = tuple(s for s in SHARDINGS if searched(sharded(s), pp))
        for sharding, replicas in hybrids((fixed["sharding"],) if "sharding" in fixed else shardings, mesh, hw, fixed):
            # built once per pair: a config's construction checks every field, the search's main cost
            hybrid = mesh.replace(dp_replicate=replicas) if replicas > 1 else mesh
            for prec in precisions:
                for v in _chunks_per_rank(pp, fixed):
                    first = 0  # the lightest checkpointing that fit a smaller microbatch: a larger one needs as much
                    sizes = _divisors(per, min(per, 64))  # ascending: memory only grows
                    if "microbatches" in fixed:
                        # a fixed m leaves one b, or none when it does not divide the sequences per data rank
                        sizes = [b for b in sizes if per // b == fixed["microbatches"]]
                        if not sizes:
                            tally.invalid(
                                f"microbatches={fixed['microbatches']} does not divide the sequences per data rank"
                            )
                    for b in sizes:
                        m = per // b
                        cfg = _layout(
                            hybrid,
                            m,
                            v,
                            sharding,
                            prec,
                            model,
                            tally,
                            fixed.get("schedule"),
                        )
                        if cfg is None:
                            continue
                        # nothing is priced that the validation refuses (the engines' own refusals aside)
                        found = layout_problems(cfg, model)
                        if found:
                            tally.invalid(found[0].split(";")[0])
                            continue
                        considered += 1
                        # the first prune, before any memory is priced: -floors[0] is the slowest of the best `top`
                        # so far (a min-heap of negated times); the floor at the lightest checkpointing still possible
                        # is the lowest any can give, so a layout that cannot beat it here never will
                        if len(floors) == top and compute_floor(cfg, model, hw, ckpts[first]) >= -floors[0]:
                            tally.invalid(f"slower than the best {top} on its compute alone")
                            continue
                        # from `first`: a larger microbatch never fits with lighter checkpointing than a
                        # smaller one needed
                        for i in range(first, len(ckpts)):
                            need = fullest_required(cfg, model, hw, ckpts[i])
                            if need <= hw.memory:
                                first = i
                                break
                        # nothing fits, not even full: one miss kept with its overshoot, and the larger b are not tried
                        else:
                            tally.too_big(cfg.replace(checkpoint_activations=ckpts[-1]), need, hw)
                            break  # larger microbatches hold more
                        cfg = cfg.replace(checkpoint_activations=ckpts[first])
                        # the checkpointing that fit may recompute more than the first prune assumed: its floor again
                        if len(floors) == top and compute_floor(cfg, model, hw, ckpts[first]) >= -floors[0]:
                            tally.invalid(f"slower than the best {top} on its compute alone")
                            continue
                        plan_ = _evaluate(cfg, model, hw)
                        timed.append(plan_)
                        if not plan_.tight:  # a tight plan ranks after every other: no floor for them
                            heapq.heappush(floors, -plan_.step_seconds)
                        if len(floors) > top:
                            heapq.heappop(floors)
    # tight plans last whatever their speed: the allocator's retries they would pay are not priced
    timed.sort(key=lambda p: (p.tight, -p.tokens_per_second_per_gpu))
    # the nearest misses: the smallest overshoot first, what a little more memory would let in
    misses = [r for _, r in sorted(tally.misses, key=lambda x: x[0])[:NEAREST]]
    out = Plans(timed[:top], misses, tally.counts, considered, len(timed), gpus)
    out.assumptions = hw.assumptions  # the hardware's and the stack's, for `labkit plan` to name
    return out


__all__ = ["plan", "Plans", "Rejected", "Plan", "stage_split"]
