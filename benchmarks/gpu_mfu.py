"""Model FLOPs utilisation of GPT-2 124M (exact architecture, tied head) in bf16 on one GPU.

    python benchmarks/gpu_mfu.py [--batch 16 32] [--steps 20]      # on a machine with a CUDA GPU

MFU = model FLOPs per step / (step seconds · peak). The peak is this device's own measured bf16
matrix-multiply rate (an 8192³ product, median of 10 after warm-up), not the datasheet's. Model
FLOPs per token are PaLM's count (Chowdhery et al. 2022, appendix B): 6·N + 12·L·h·s, N the
parameters a token's matmuls touch (every parameter but the position table; the tied embedding
counts once, as the LM head's matmul), the second term attention's scores and weighted sum.

What is measured, each on labkit's own model code (engines/model.py):
  lab        Lab(engines=1) on the GPU, precision='bf16', every meter on (the comm log, the
             saved-tensor hooks, CUDA-event timeline): what a notebook user sees
  lab-gil5ms the same with the engine's GIL switch interval at Python's 5 ms instead of labkit's 0.1 ms
  eager      one process, fp32 master weights under torch.autocast(bf16), fused AdamW, no meters
  compiled   the same under torch.compile (flash attention through scaled_dot_product_attention)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from common import machine, table  # noqa: E402

from labkit import theory  # noqa: E402
from labkit.theory.presets import GPT2_124M  # noqa: E402


def matmul_peak(n: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times)


def flops_per_token(model) -> float:
    """PaLM's 6N + 12·L·h·s (appendix B), N without the position table."""
    n = theory.num_params(model) - (model.seq * model.hidden if model.arch in ("gpt", "gpt2") else 0)
    return 6 * n + 12 * model.layers * model.hidden * model.seq


def one_process(model_cfg, batch: int, steps: int, compiled: bool) -> float:
    """Median step seconds of a plain training loop on labkit's model: bf16 autocast, fused AdamW."""
    from labkit.engines.model import build_model

    net = build_model(model_cfg, seed=0).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(net) if compiled else net
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab, (batch, model_cfg.seq), device="cuda", generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    times = []
    for i in range(steps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:  # warm-up (and compilation) left out
            times.append(start.elapsed_time(end) / 1e3)
    del net, opt
    torch.cuda.empty_cache()
    return statistics.median(times)


def in_the_lab(model_cfg, batch: int, steps: int, switch: float | None) -> tuple[float, float]:
    """Median steady step seconds of lab.run (bf16, every meter on) and the allocator peak."""
    from labkit import Lab, ParallelConfig

    def set_switch(s):
        import sys as _sys

        _sys.setswitchinterval(s)

    cfg = ParallelConfig(dp=1, global_batch=batch, precision="bf16")
    with Lab(engines=1, device="cuda", progress=False, timeout=600) as lab:
        if switch is not None:
            lab.apply(set_switch, switch)
        res = lab.run(cfg, model=model_cfg, steps=steps)
    return statistics.median(res.ranks[0].step_times[3:]), res.ranks[0].memory["peak"]


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-lab", action="store_true")
    ns = ap.parse_args()
    peak = matmul_peak()
    model = GPT2_124M
    per_token = flops_per_token(model)
    rows = [
        ("device", f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"),
        ("measured bf16 matmul peak (8192³)", f"{peak / 1e12:.0f} TFLOP/s"),
        ("model FLOPs per token (6N + 12·L·h·s)", f"{per_token / 1e9:.3f} GFLOP"),
    ]
    t0 = time.time()
    for batch in ns.batch:
        tokens = batch * model.seq
        variants = [
            ("compiled", lambda b=batch: one_process(model, b, ns.steps, True)),
            ("eager", lambda b=batch: one_process(model, b, ns.steps, False)),
        ]
        if not ns.skip_lab:
            variants += [
                ("lab", lambda b=batch: in_the_lab(model, b, ns.steps, None)[0]),
                ("lab-gil5ms", lambda b=batch: in_the_lab(model, b, ns.steps, 5e-3)[0]),
            ]
        for name, fn in variants:
            step = fn()
            mfu = per_token * tokens / step / peak
            rows.append(
                (
                    f"{name:<10} batch {batch:>2} x {model.seq}",
                    f"{step * 1e3:7.1f} ms  {tokens / step:9,.0f} tok/s  MFU {mfu:5.1%}",
                )
            )
            print(rows[-1], flush=True)
    print(f"machine: {machine()}  ({time.time() - t0:.0f} s)")
    print(table(rows))


if __name__ == "__main__":
    main()
