"""The theory's outputs on a fixed set of layouts, digested, so that a change meant to keep them
(a refactor, a rename, a split) is checked to the last bit: `theory.estimate` (every rank's memory
by category, every comm row, the bubble) and `theory.evaluate` on 2,000+ layouts, and
`theory.plan`'s ranked answers for a few models and GPU counts.

    python tests/theory_snapshot.py write     # record tests/data/theory_snapshot.json (before a change)
    python tests/theory_snapshot.py check     # compare (tests/test_theory_snapshot.py does this)

A snapshot is re-recorded only in a commit that says which modelling change moved which outputs.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import sys

from labkit import ConfigError, ModelConfig, ParallelConfig, theory
from labkit.theory.presets import GPT2_124M, LLAMA31_8B, LLAMA32_1B, MIXTRAL_8X7B

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "theory_snapshot.json")

MODELS = {
    "gpt": ModelConfig(layers=4, hidden=64, heads=4, ffn=256, vocab=256, seq=64),
    "llama-gqa": ModelConfig(arch="llama", layers=4, hidden=64, heads=8, kv_heads=2, ffn=192, vocab=256, seq=64),
    "moe": ModelConfig(layers=4, hidden=64, heads=4, ffn=128, vocab=256, seq=64, experts=4, top_k=2),
    "gpt2-124m": GPT2_124M,
    "llama3.2-1b": LLAMA32_1B,
}
SCALE = {"llama3.1-8b": LLAMA31_8B, "mixtral-8x7b": MIXTRAL_8X7B}
DEGREES = (1, 2, 4)


def candidates():
    """Every combination of the choice fields over small meshes, in a fixed order."""
    for name in MODELS:
        for dp, tp, pp, cp, ep in itertools.product(DEGREES, DEGREES, DEGREES, (1, 2), (1, 2)):
            for sharding, impl, precision, schedule, ckpt, sp in itertools.product(
                ("none", "zero1", "zero2", "zero3", "fsdp"),
                ("lab", "torch"),
                ("fp32", "bf16"),
                ("gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"),
                (False, True, "selective"),
                (False, True),
            ):
                if pp == 1 and schedule != "1f1b":
                    continue
                virtual = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
                micro = 2 * pp if pp > 1 else 1
                yield (
                    name,
                    dict(
                        dp=dp,
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        ep=ep,
                        sharding=sharding,
                        impl=impl,
                        precision=precision,
                        schedule=schedule,
                        virtual_stages=virtual,
                        microbatches=micro,
                        checkpoint_activations=ckpt,
                        sequence_parallel=sp,
                        global_batch=8 * dp * ep * micro,
                    ),
                )


def layouts(n: int = 2400):
    """n valid layouts, sampled with a fixed seed from `candidates` (the valid ones only)."""
    pool = list(candidates())
    random.Random(2026).shuffle(pool)
    out = []
    for name, kw in pool:
        try:
            cfg = ParallelConfig(**kw)
            theory.estimate(cfg, MODELS[name])
        except (ConfigError, ValueError, TypeError):
            continue
        out.append((name, kw))
        if len(out) == n:
            break
    return out


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()[:16]


ADDED_AT_DEFAULT = {
    "cp_kind": "ring",
    "cp_a2a": 1,
    "dp_replicate": 1,
    "compile": False,
    # the dense attention families
    "kv_channels": None,
    "qk_norm": False,
    "nope_interval": 0,
    "sliding_window": None,
    "window_pattern": 0,
    "rope_local_theta": None,
    "rope_linear_factor": 1.0,
    "query_pre_attn_scalar": None,
    # fp8 executed
    "fp8_recipe": "tensorwise",
}
"""Config fields added after the snapshot was recorded, with the default that keeps the old
behaviour: left out of a plan's config while they hold it, so a new choice proves it moved nothing."""


def _config(cfg) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if ADDED_AT_DEFAULT.get(k, object()) != v}


def _plan_row(p) -> dict:
    return {
        "config": _config(p.config),
        "peak": p.peak_bytes,
        "step": p.step_seconds,
        "tps": p.tokens_per_second_per_gpu,
        "mfu": p.mfu,
        "bound": p.bound,
        "fits": p.fits,
        "tight": p.tight,
        "why": p.why,
        "breakdown": p.breakdown,
    }


def outputs() -> dict:
    """'estimate <layout>' -> digest of the exact theory's answer (memory, comm rows, bubble) and
    'evaluate <layout>' -> digest of the planner's; 'plan <model> <gpus>' -> the planner's search.
    The two kinds are apart so that a change to the planner's time model, which moves `evaluate`
    and `plan`, is seen to leave the exact theory's digests alone."""
    out = {}
    for name, kw in layouts():
        cfg, model = ParallelConfig(**kw), MODELS[name]
        est = theory.estimate(cfg, model)
        key = f"{name} " + json.dumps(kw, sort_keys=True)
        out[f"estimate {key}"] = digest({"memory": est.memory, "comm": list(est.comm_table()), "bubble": est.bubble})
        try:
            got = _plan_row(theory.evaluate(cfg, model, "h100"))
        except ConfigError as e:
            got = str(e)
        out[f"evaluate {key}"] = digest(got)
    for (name, model), gpus in itertools.product(SCALE.items(), (8, 64)):
        plans = theory.plan(model, gpus, "h100", top=5)
        out[f"plan {name} {gpus}"] = digest(
            {"plans": [_plan_row(p) for p in plans], "counts": plans.counts, "considered": plans.considered}
        )
    return out


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "check"
    got = outputs()
    if what == "write":
        os.makedirs(os.path.dirname(PATH), exist_ok=True)
        with open(PATH, "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
        print(f"{len(got)} outputs recorded in {PATH}")
        return
    with open(PATH) as f:
        want = json.load(f)
    differ = sorted(k for k in want if got.get(k) != want[k])
    kinds = {kind: sum(k.startswith(kind + " ") for k in differ) for kind in ("estimate", "evaluate", "plan")}
    print(f"{len(want)} outputs, {len(differ)} differ {kinds}" + "".join(f"\n  {k}" for k in differ[:20]))
    sys.exit(1 if differ or set(got) != set(want) else 0)


if __name__ == "__main__":
    main()
