"""An fp8 layout ran in fp8: what each rank's step executed in float8, held to what its layout converts.

A layout that says precision='fp8' and computes in bf16 differs from the fp8 reference by fp8's rounding
alone, which a bound made for layouts that split their casts (TP) has to allow: the numbers cannot show
that fp8 never ran. The count can. Each rank reports its `aten::_scaled_mm` calls per step, forward and
backward (engines/meters/float8.py); each linear layer its layout converts (labkit/layout/float8.py
`converts`, torchtitan's filter, judged on the full model) runs three per microbatch, torchao's float8
training: the output (forward), the input's and the weight's gradients (backward).
"""

from __future__ import annotations

from labkit.config.choices import numerics
from labkit.layout.float8 import float8_weights
from labkit.layout.schedules import stage_of, style
from labkit.theory.exact.pipeline import chunk_full_shapes

MATMULS = {"forward": 1, "backward": 2}
"""fp8 matmuls per converted linear and microbatch (torchao's Float8Linear: output; input and weight gradients)."""


def expected(cfg, model, pp_rank: int) -> dict[str, int]:
    """{'forward': n, 'backward': n}: the fp8 matmuls one step of the rank at pipeline coordinate `pp_rank`
    runs: every converted linear of its chunks (a tp rank its slice of each), per microbatch. A schedule that
    splits backward into B and W (zero-bubble: engines/parallel/pipeline/'s executor) runs the fp8 Function's
    backward in each on a chunk with a stage before it, both matmuls each time (a Function's backward cannot
    return one of its gradients alone); the first stage's B has no input to differentiate, and W runs once."""
    out = {"forward": 0, "backward": 0}
    for c, chunk in enumerate(chunk_full_shapes(cfg, model, pp_rank)):
        layers = len(float8_weights(chunk)) * cfg.microbatches
        stage = stage_of(pp_rank, c, cfg.pp, style(cfg.schedule)) if cfg.pp > 1 else 0
        twice = cfg.pp > 1 and cfg.pipeline.splits_backward and stage > 0
        out["forward"] += MATMULS["forward"] * layers
        out["backward"] += MATMULS["backward"] * layers * (2 if twice else 1)
    return out


def float8_problems(result) -> list[str]:
    """Each rank and step whose fp8 matmuls are not what its layout converts (empty for other precisions)."""
    cfg, model = result.config, result.model
    if not numerics(cfg.precision).fp8:
        return []
    out = []
    for rk in result.ranks:
        want = expected(cfg, model, rk.coords["pp"])
        if len(rk.float8_matmuls) != result.steps:
            out.append(f"rank {rk.rank} reported fp8 matmuls for {len(rk.float8_matmuls)} of {result.steps} steps")
            continue
        bad = [(s, ran) for s, ran in enumerate(rk.float8_matmuls) if ran != want]
        if bad:
            s, ran = bad[0]
            out.append(
                f"rank {rk.rank} ran {ran['forward']} forward and {ran['backward']} backward fp8 matmuls at "
                f"step {s} ({len(bad)} step(s) off); its layout converts the layers of {want['forward']} forward "
                f"and {want['backward']} backward ({cfg.microbatches} microbatch(es), torchtitan's filter): "
                "the rest computed in bf16" + (" — none ran in fp8" if ran["forward"] + ran["backward"] == 0 else "")
            )
    return out
