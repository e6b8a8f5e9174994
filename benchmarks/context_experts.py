"""Context and expert parallelism, measured: ring K/V bytes, all-to-all bytes, memory per rank and
step times, each next to the theory's prediction.

    python benchmarks/context_experts.py       # 4 CPU engines, the default model (and a 4-expert MoE)

Context parallelism is run at one sequence length and one global batch for cp = 1, 2, 4 (dp = 1,
so the cp ranks split only the sequence): activation memory per rank should fall as 1/cp.
Step times are medians (over ranks, and over interleaved repeats, the first step of each run
dropped as warm-up); on a 2-core machine shared with other work they are indicative only.
"""

from __future__ import annotations

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import ab, machine, table  # noqa: E402

from labkit import Lab, ModelConfig, ParallelConfig, theory  # noqa: E402


def per_layer(res, op: str, layers: int) -> float:
    """Bytes rank 0 sends per layer in the last step by `op` (payload bytes: for send, the wire)."""
    return sum(c.payload_bytes for c in res.ranks[0].comm if c.op == op and c.step == res.steps - 1) / layers


def main() -> None:
    model = ModelConfig()
    moe = model.replace(experts=4, top_k=2)
    rows = []
    with Lab(engines=4, progress=False) as lab:
        cps = {f"cp={c}": ParallelConfig(cp=c, global_batch=8) for c in (1, 2, 4)}
        for name, cfg in cps.items():
            res = lab.run(cfg, model=model, steps=2)
            est = theory.estimate(cfg, model)
            mem = res.ranks[0].memory
            rows.append(
                (f"{name}: K/V sent per layer per step (rank 0)", f"{per_layer(res, 'send', model.layers):,.0f} B")
            )
            rows.append(
                (
                    f"{name}: activations / peak per rank",
                    f"{mem['activations']:,} B (theory {est.memory[0]['activations']:,}) / {mem['peak']:,} B",
                )
            )
        times = ab(lab, cps, model, repeats=3, steps=4)
        rows += [(f"{name}: step time", f"{t * 1e3:.1f} ms") for name, t in times.items()]
        eps = {
            "dp=4 (ep=1)": ParallelConfig(dp=4),
            "ep=2 x dp=2": ParallelConfig(ep=2, dp=2),
            "ep=4": ParallelConfig(ep=4),
        }
        for name, cfg in eps.items():
            res = lab.run(cfg, model=moe, steps=2)
            est = theory.estimate(cfg, moe)
            sent = [
                sum(c.payload_bytes for c in rk.comm if c.op == "all_to_all" and c.step == 1) / moe.layers
                for rk in res.ranks
            ]
            if cfg.ep > 1:
                want = sum(r["payload_bytes"] for r in est.comm_table() if r["op"] == "all_to_all" and r["rank"] == 0)
                rows.append(
                    (
                        f"MoE {name}: all-to-all bytes per layer per step, per rank",
                        " ".join(f"{s:,.0f}" for s in sent) + f" (balanced theory {want / moe.layers:,.0f})",
                    )
                )
            rows.append(
                (
                    f"MoE {name}: params / activations per rank (rank 0)",
                    f"{res.ranks[0].memory['params']:,} / {res.ranks[0].memory['activations']:,} B",
                )
            )
        times = ab(lab, eps, moe, repeats=3, steps=4)
        rows += [(f"MoE {name}: step time", f"{t * 1e3:.1f} ms") for name, t in times.items()]
    print(f"machine: {machine()}")
    print(table(rows))


if __name__ == "__main__":
    main()
