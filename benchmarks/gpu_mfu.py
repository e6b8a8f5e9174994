"""Model FLOPs utilisation on one GPU, and labkit's strategies against PyTorch's at world 2.

    python benchmarks/gpu_mfu.py --out mfu.json [--trace trace.json] [--parts one lab pairs]

MFU = model FLOPs per step / (step seconds · peak). The peak is this device's own measured bf16
matrix-multiply rate (an 8192³ product, median of 10 after warm-up), not the datasheet's. Model
FLOPs per token are PaLM's count (Chowdhery et al. 2022, appendix B): 6·N + 12·L·h·s, N the
parameters a token's matmuls touch (every parameter but the position table; a tied embedding
counts once, as the LM head's matmul), the second term attention's scores and weighted sum over
the whole s×s square (causal attention does half of it; PaLM, and nanoGPT's estimate_mfu, count
it whole, so these MFUs are comparable with theirs).

The models, each on labkit's own model code (engines/model.py), exact architectures:
  GPT-2 124M     12 x 768, seq 1024, batch 16 (16,384 tokens a step)
  Llama 3.2 1B   16 x 2048, GQA 32/8, tied, seq 2048 (the preset's 8192 cut for one GPU's step), batch 8

What is measured (median step of the steady steps, CUDA events):
  one       a plain one-process loop: fp32 master weights under torch.autocast(bf16), fused AdamW,
            no meters; eager, and compiled (torch.compile of the whole model)
  lab       Lab(engines=1) on the GPU, precision='bf16', every meter on: what a notebook user sees
  pairs     world 2 on one GPU (the two ranks time-share it; NCCL when it runs two ranks on one
            GPU, else gloo on CUDA: the JSON says which), GPT-2 124M, labkit's implementation and
            PyTorch's of the same layout: DDP, FSDP (ZeRO-3 / FSDP2), TP (DTensor), 1F1B
            (torch.distributed.pipelining). Step time ours / PyTorch's.
The JSON is rewritten after every row; --trace saves one Lab run's timeline (CUDA events) for Perfetto.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback

import torch

from labkit import theory
from labkit.theory.presets import GPT2_124M, LLAMA32_1B

MODELS = {
    "llama3.2-1b": (LLAMA32_1B.replace(seq=2048), 8),
    "gpt2-124m": (GPT2_124M, 16),
}


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


def one_process(model_cfg, batch: int, steps: int, compiled: bool) -> dict:
    """Median step seconds of a plain training loop on labkit's model: bf16 autocast, fused AdamW."""
    from labkit.engines.model import build_model

    net = build_model(model_cfg, seed=0).cuda()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(net) if compiled else net
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab, (batch, model_cfg.seq), device="cuda", generator=gen)
    targets = torch.roll(tokens, -1, dims=1)
    times = []
    torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    warm = 3
    for i in range(steps + warm):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if i >= warm:  # warm-up (and compilation) left out
            times.append(start.elapsed_time(end) / 1e3)
        if i == warm - 1:
            first = time.monotonic() - t0
    peak = torch.cuda.max_memory_allocated()
    kernels = profile_step(functools.partial(step, fwd, opt, tokens, targets))
    del net, opt, fwd
    torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "warmup_s": first, "peak_bytes": peak, "kernels": kernels}


def step(fwd, opt, tokens, targets) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = fwd(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


KINDS = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "efficient")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "gemv")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)


def profile_step(fn) -> dict:
    """Where one step's GPU time goes: kernel time by kind (matmul, attention, optimizer, the
    rest: elementwise, norms, softmax, copies), the SDPA kernels by name (which backend SDPA
    chose: flash, cuDNN, efficient or the math path's matmuls), and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_kind = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    names: dict[str, float] = {}
    calls = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if hasattr(e, "device_time") else e.cuda_time
        name = e.name.lower()
        kind = next((k for k, keys in KINDS if any(x in name for x in keys)), "other")
        by_kind[kind] += us / 1e6
        calls += 1
        if kind == "attention":
            names[e.name[:120]] = names.get(e.name[:120], 0.0) + us / 1e6
    return {"wall_s": wall, "kernel_s": by_kind, "kernels": calls, "attention_kernels": names}


def in_the_lab(lab, model_cfg, batch: int, steps: int, cfg=None, trace: str | None = None) -> dict:
    """Median steady step seconds of lab.run (every meter on) and the allocator peak of rank 0."""
    from labkit import ParallelConfig

    cfg = cfg or ParallelConfig(dp=1, global_batch=batch, precision="bf16")
    res = lab.run(cfg, model=model_cfg, steps=steps, timeout=600)
    if trace:
        res.save_trace(trace)
    times = res.ranks[0].step_times[2:]
    return {"step_s": statistics.median(times), "peak_bytes": res.ranks[0].memory["peak"], "steps": len(times)}


PAIRS = [
    ("ddp", dict(dp=2), "fp32"),
    ("fsdp", dict(dp=2, sharding="fsdp"), "bf16"),
    ("tp", dict(tp=2), "fp32"),
    ("1f1b", dict(pp=2, microbatches=4, schedule="1f1b"), "fp32"),
]


def hardware_of_device(name: str) -> str:
    """The theory's hardware for a CUDA device name (H100 80GB or H200; else the H100's)."""
    return "h200" if "H200" in name else "h100"


def theory_beside(row: dict, hardware: str) -> dict:
    """The theory's step for a one-rank row (theory.evaluate on the row's model, batch and
    stack: 'compile' for the compiled rows), and its error against the measured step."""
    from labkit import ParallelConfig

    model, batch = MODELS[row["model"]]
    compiled = "compiled" in row["what"]
    precision = "fp8" if "fp8" in row["what"] else "bf16"
    plan = theory.evaluate(ParallelConfig(global_batch=batch, precision=precision, compile=compiled), model, hardware)
    return {
        "theory_step_s": plan.step_seconds,
        "theory_error": plan.step_seconds / row["step_s"] - 1,
        "theory_hardware": hardware,
    }


def print_beside(path: str) -> None:
    """`--beside mfu.json`: each measured one-rank step with the theory's, from a saved run."""
    with open(path) as f:
        got = json.load(f)
    hardware = hardware_of_device(got["device"])
    print(f"{got['device']} ({hardware}), torch {got['torch']}")
    for row in got["rows"]:
        if "step_s" in row:
            t = theory_beside(row, hardware)
            print(
                f"{row['model']:12s} {row['what']:13s} measured {row['step_s'] * 1e3:7.1f} ms"
                f"  theory {t['theory_step_s'] * 1e3:7.1f} ms  ({t['theory_error']:+.1%})"
            )


def main() -> None:
    if "--beside" in sys.argv:
        print_beside(sys.argv[sys.argv.index("--beside") + 1])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mfu.json")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--parts", nargs="+", default=["one", "lab", "pairs"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--pairs", nargs="+", default=[p[0] for p in PAIRS])
    ap.add_argument("--kinds", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    ap.add_argument("--precisions", nargs="+", default=["bf16"], choices=["bf16", "fp8"], help="the Lab's eager rows")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    if ns.dry_run:
        with open(ns.out, "w") as f:
            json.dump({"dry_run": True, "parts": ns.parts, "rows": [], "pairs": []}, f)
        return
    from labkit import Lab, ParallelConfig

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run)")
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rows": [],
        "pairs": [],
    }

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    peak = matmul_peak()
    out["peak_bf16_flops"] = peak
    print(f"{out['device']}: bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    save()

    def row(name, model_name, fn):
        model, batch = MODELS[model_name]
        tokens = batch * model.seq
        r = {"what": name, "model": model_name, "batch": batch, "seq": model.seq}
        t0 = time.monotonic()
        try:
            r.update(fn(model, batch))
            r["tokens_per_s"] = tokens / r["step_s"]
            r["mfu"] = flops_per_token(model) * tokens / r["step_s"] / peak
            r.update(theory_beside(r, hardware_of_device(out["device"])))  # priced before it is read
        except Exception as e:  # noqa: BLE001 - a row records what failed and the next one runs
            r["error"] = f"{type(e).__name__}: {e}"[:1500]
            traceback.print_exc()
        r["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(r), flush=True)
        out["rows"].append(r)
        save()

    def compiled(batch: int):
        return ParallelConfig(dp=1, global_batch=batch, precision="bf16", compile=True)

    def eager(batch: int, precision: str):
        return ParallelConfig(dp=1, global_batch=batch, precision=precision)

    # the Lab's rows first, and its compiled ones first: the targets are theirs, and a
    # stage cut at its limit keeps what it reached; then the plain loop's, in the models' order given
    for model_name in ns.models if "lab" in ns.parts else ():
        with Lab(engines=1, device="cuda", progress=False, timeout=600) as lab:
            if "compiled" in ns.kinds:
                row("lab compiled", model_name, lambda m, b: in_the_lab(lab, m, b, ns.steps + 2, compiled(b)))
            for p in ns.precisions if "eager" in ns.kinds else ():
                name = "lab eager" + ("" if p == "bf16" else f" {p}")  # fp8: tokens/s against bf16's row
                row(name, model_name, lambda m, b, p=p: in_the_lab(lab, m, b, ns.steps + 2, eager(b, p)))
    for model_name in ns.models if "one" in ns.parts else ():
        if "compiled" in ns.kinds:
            row("one compiled", model_name, lambda m, b: one_process(m, b, ns.steps, True))
        if "eager" in ns.kinds:
            row("one eager", model_name, lambda m, b: one_process(m, b, ns.steps, False))
    if "pairs" in ns.parts:
        model, batch = MODELS["gpt2-124m"]
        with Lab(engines=2, device="cuda", progress=False, timeout=600) as lab:
            out["pairs_backend"], out["pairs_backend_reason"] = lab.backend, lab.backend_reason
            for name, kw, precision in [p for p in PAIRS if p[0] in ns.pairs]:
                pair = {"layout": name, "precision": precision}
                for impl in ("lab", "torch"):
                    cfg = ParallelConfig(global_batch=batch, precision=precision, impl=impl, **kw)
                    # tp splits the vocabulary: GPT-2's 50257 padded to 50304 as nanoGPT pads it
                    m = model.replace(vocab=50304) if kw.get("tp", 1) > 1 else model
                    try:
                        got = in_the_lab(
                            lab,
                            m,
                            batch,
                            ns.steps + 2,
                            cfg,
                            trace=ns.trace if (name, impl) == ("ddp", "lab") else None,
                        )
                        pair[impl] = got["step_s"]
                    except Exception as e:  # noqa: BLE001
                        pair[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:1500]
                if "lab" in pair and "torch" in pair:
                    pair["ours_over_torch"] = pair["lab"] / pair["torch"]
                print(json.dumps(pair), flush=True)
                out["pairs"].append(pair)
                save()


if __name__ == "__main__":
    main()
