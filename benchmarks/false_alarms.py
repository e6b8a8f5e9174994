"""The oracle's false-alarm sweep: random correct runs, each held to the one-process reference.

Every draw is a layout labkit builds, on a model of one of the families (gpt, gpt2, llama, a
Mixtral-shaped MoE, a DeepSeek-V3-shaped MoE with its sigmoid router, groups, shared expert and
dense first block, DeepSeek-V3's MLA), a seed, a precision (fp32, bf16 twice as often, fp8), microbatches
and steps — drawn by a
seeded generator, so a sweep is repeatable. A draw that labkit refuses (validation.problems) is
drawn again. Each run is judged by `labkit.oracle.checks` against the reference replayed along it
(labkit/oracle/replay.py): a mismatch on a correct run is a false alarm, and the sweep's verdict is
their count, which must be 0. Beside it, per check, the largest margin (error over bound) any run
came to, and the routing ties the replay followed.

    python benchmarks/false_alarms.py --runs 300 --seed 0 [--json out.json]

tests/test_false_alarms.py runs a few draws of the same generator in the suite (another seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from labkit import ModelConfig, ParallelConfig
from labkit.config.validation import not_built_yet, problems

ENGINES = 4

FAMILIES = {
    "gpt": ModelConfig(layers=2, hidden=32, heads=4, ffn=64, vocab=96, seq=16),
    "gpt2": ModelConfig(arch="gpt2", layers=2, hidden=48, heads=4, ffn=96, vocab=120, seq=16),
    "llama": ModelConfig(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=96, seq=16),
    "mixtral": ModelConfig(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=96, seq=16,
                           experts=4, top_k=2),
    "deepseek-moe": ModelConfig(arch="llama", layers=3, hidden=32, heads=4, ffn=64, vocab=128, seq=16, experts=8,
                                top_k=3, moe_ffn=16, shared_experts=1, norm_topk_prob=True, router="sigmoid",
                                n_group=4, topk_group=2, routed_scaling_factor=2.5, dense_layers=1,
                                bias_update_speed=0.01, aux_loss_coef=0.001),
    "mla": ModelConfig(arch="deepseek_v3", layers=2, hidden=32, heads=4, ffn=64, vocab=128, seq=16, q_lora_rank=16,
                       kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
}  # fmt: skip
"""Small models of each family (tests/test_moe_fine.py's DeepSeek-V3 toy, tests/mla_models.py's MLA)."""

LAYOUTS = [
    dict(dp=2), dict(dp=4), dict(dp=2, sharding="zero1"), dict(dp=4, sharding="zero2"), dict(dp=4, sharding="zero3"),
    dict(dp=2, sharding="fsdp"), dict(dp=4, sharding="fsdp", impl="torch"), dict(dp=4, dp_replicate=2, sharding="fsdp"),
    dict(dp=4, dp_replicate=2, sharding="zero3"), dict(dp=2, impl="torch"),
    dict(tp=2), dict(tp=2, sequence_parallel=True), dict(tp=2, dp=2, sequence_parallel=True), dict(tp=4),
    dict(pp=2), dict(pp=2, dp=2), dict(pp=2, schedule="gpipe"), dict(pp=2, schedule="zbh1"),
    dict(pp=2, virtual_stages=2), dict(pp=4),
    dict(cp=2), dict(cp=2, dp=2), dict(cp=2, cp_kind="allgather"), dict(cp=2, cp_kind="ulysses"), dict(cp=4),
    dict(cp=4, cp_kind="hierarchical", cp_a2a=2),
    dict(tp=2, pp=2), dict(tp=2, cp=2), dict(pp=2, cp=2), dict(dp=2, sharding="zero1", pp=2),
    dict(ep=2), dict(ep=4), dict(ep=2, dp=2), dict(ep=2, tp=2, sequence_parallel=True), dict(ep=2, pp=2),
    dict(ep=2, cp=2), dict(dp=2, checkpoint_activations=True), dict(tp=2, checkpoint_activations=True),
]  # fmt: skip
"""Every strategy alone and the compositions the tests build, at world 2 or 4."""


def label(cfg: ParallelConfig) -> str:
    """The fields a draw set, away from their defaults: 'dp=2 sharding=zero3 precision=bf16'."""
    default = ParallelConfig().to_dict()
    return " ".join(f"{k}={v}" for k, v in cfg.to_dict().items() if v != default.get(k))


def draw(rng: random.Random) -> tuple[str, ModelConfig, ParallelConfig, int, int]:
    """One correct run: (family, model, layout, seed, steps). Redrawn until labkit builds it."""
    while True:
        family = rng.choice(sorted(FAMILIES))
        model = FAMILIES[family]
        if rng.random() < 0.5:  # another depth or width of the same family
            model = model.replace(layers=max(model.layers + rng.choice([-1, 1]), 1 + model.dense_layers))
        fields = dict(rng.choice(LAYOUTS))
        fields["precision"] = rng.choice(["fp32", "bf16", "bf16", "fp8"])  # most runs mixed: where people train
        fields["microbatches"] = rng.choice([1, 1, 2, 4])
        fields["global_batch"] = rng.choice([4, 8, 8, 16])
        try:
            cfg = ParallelConfig(**fields)
        except Exception:  # a field value refused on its own: draw again
            continue
        if problems(cfg, model, ENGINES) or not_built_yet(cfg, model):
            continue
        return family, model, cfg, rng.randrange(1000), rng.choice([2, 3, 3, 4])


def sweep(lab, runs: int, seed: int, progress=print) -> dict:
    """`runs` draws of the generator seeded `seed`, each run and judged. Returns the counts, the
    largest margin per check, the flips and every false alarm (with its draw, to rerun it)."""
    from labkit import reference
    from labkit.oracle.arithmetic import arithmetic
    from labkit.oracle.checks import margins, mismatches

    rng = random.Random(seed)
    out = {"runs": 0, "false_alarms": [], "worst": {}, "flips": 0, "by_family": {}, "by_precision": {}, "seconds": 0.0}
    out["by_arithmetic"] = {}
    t0 = time.monotonic()
    for i in range(runs):
        family, model, cfg, s, steps = draw(rng)
        res = lab.run(cfg, model=model, steps=steps, seed=s, return_params=True, timeout=300)
        ref = reference(model, steps=steps, seed=s, global_batch=cfg.global_batch)
        found = mismatches(res, ref)
        over = margins(res, ref)
        out["runs"] += 1
        out["flips"] += int(over.pop("flips", 0))
        # the largest margin per check and per bound's kind: one rounding (shared arithmetic), fp32's, the chain's
        kind = "shared" if arithmetic(res).shared else "fp32" if cfg.precision == "fp32" else "counted"
        out["by_arithmetic"][kind] = out["by_arithmetic"].get(kind, 0) + 1
        for k, v in over.items():
            key = f"{k} ({kind})"
            if v > out["worst"].get(key, (-1.0,))[0]:
                out["worst"][key] = (v, f"{family} {label(cfg)} seed {s} steps {steps}")
        out["by_family"][family] = out["by_family"].get(family, 0) + 1
        out["by_precision"][cfg.precision] = out["by_precision"].get(cfg.precision, 0) + 1
        if found:
            out["false_alarms"].append(
                {
                    "draw": i,
                    "family": family,
                    "cfg": cfg.to_dict(),
                    "seed": s,
                    "steps": steps,
                    "found": [str(f) for f in found],
                }
            )
        verdict = f"FALSE ALARM {found[0]}" if found else "ok"
        seen = " ".join(f"{k} {v:.3g}" for k, v in over.items())
        progress(f"{i + 1}/{runs} {family} {label(cfg)} seed={s} steps={steps}: {verdict} {seen}")
    out["seconds"] = time.monotonic() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    from labkit import Lab

    with Lab(engines=ENGINES, progress=False, device="cpu") as lab:
        out = sweep(lab, args.runs, args.seed)
    print(
        f"\n{out['runs']} correct runs, {len(out['false_alarms'])} false alarm(s), "
        f"{out['flips']} routing ties followed, "
        f"{out['seconds']:.0f} s; by family {out['by_family']}, by precision {out['by_precision']}, "
        f"by the reference's arithmetic {out['by_arithmetic']}"
    )
    for k, (v, where) in sorted(out["worst"].items()):
        print(f"  largest {k} margin {v:.3g}  ({where})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 1 if out["false_alarms"] else 0


if __name__ == "__main__":
    sys.exit(main())
