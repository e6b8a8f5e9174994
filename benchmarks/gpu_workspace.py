"""cuBLAS's workspaces in a training step's allocator peak, measured.

On an H100 (2026-11-26) the allocator's peak of a one-GPU step was 135.30 MB (fp32) and 135.38 MB
(bf16) above the theory's on the tiny model: a constant, consistent with cuBLAS's Hopper workspace
(32 MiB per handle and stream, torch's default CUBLAS_WORKSPACE_CONFIG ':4096:8') held four times over.
That was a reading, not a measurement. This measures it, each case in a fresh process (cuBLAS reads
CUBLAS_WORKSPACE_CONFIG when it makes its first handle):

  one         one bf16 product on the main thread: the allocator's bytes after it, less the product's
              output and inputs (one workspace), and what torch._C._cuda_clearCublasWorkspaces frees
  step        two training steps of a small GPT (fp32 weights, bf16 autocast, fused AdamW; backward on
              autograd's own device thread, as in every step): the peak, and what clearing the
              workspaces frees after it
  step, none  the same with no workspace (CUBLAS_WORKSPACE_CONFIG=':0:0', and cuBLASLt's size 0)
`workspace_bytes`, what the theory reads, is the step's peak less the same step's peak without them:
what they add to max_memory_allocated, whichever threads made them (the clear, which may only see
this thread's, and one product's workspace are kept beside it to say how many there were).

The model is not benchmarks/gpu_layouts.py's memory model, whose peak against the theory (plus this
constant) is the validation row: calibration stays apart from validation (theory/planner/calibration.py).

    python benchmarks/gpu_workspace.py --out workspace.json      # on a CUDA GPU, ~30 s
    python benchmarks/gpu_workspace.py --dry-run --out x.json    # arguments and the file's frame only

Keep it as benchmarks/gpu_workspace_<h100|h200>.json: the theory's GPU peak reads `workspace_bytes`
from there (calibration.load_workspace; hardware.py `workspace`), and says "not measured" without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = {"one": {}, "step": {}, "step, none": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}}
MODEL = dict(arch="gpt2", layers=2, hidden=128, heads=4, ffn=512, vocab=2048, seq=128)


def case(name: str) -> dict:
    """One case in this (fresh) process."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch.cuda.init()
    torch.ones(1, device="cuda")
    if name == "one":
        a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        before = torch.cuda.memory_allocated()
        c = a @ b
        torch.cuda.synchronize()
        got = {"after_product": torch.cuda.memory_allocated() - before - c.numel() * c.element_size()}
    else:
        from labkit import ModelConfig
        from labkit.engines.model import build_model

        cfg = ModelConfig(**MODEL)
        net = build_model(cfg, seed=0).cuda()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, cfg.vocab, (8, cfg.seq), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = net(tokens, torch.roll(tokens, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        got = {"peak": torch.cuda.max_memory_allocated()}
    held = torch.cuda.memory_allocated()
    if clear is not None:
        clear()
        got["freed_by_clear"] = held - torch.cuda.memory_allocated()
    got["env"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return got


def run(name: str, limit: float) -> dict:
    env = {**os.environ, **CASES[name]}
    got = subprocess.run(
        [sys.executable, __file__, "--case", name], env=env, capture_output=True, text=True, timeout=limit
    )
    line = next((x for x in got.stdout.splitlines()[::-1] if x.startswith("{")), None)
    if got.returncode or line is None:
        return {"error": (got.stderr.strip().splitlines() or [f"rc {got.returncode}"])[-1][:500]}
    return json.loads(line)


def summary(cases: dict) -> dict:
    """The constant the theory reads, and its cross-checks: None where a case did not measure it."""
    step, none, one = cases.get("step", {}), cases.get("step, none", {}), cases.get("one", {})
    out = {"workspace_bytes": step["peak"] - none["peak"] if "peak" in step and "peak" in none else None}
    out["freed_by_clear_after_the_step"] = step.get("freed_by_clear")
    if one.get("freed_by_clear"):
        out["one_workspace_bytes"] = one["freed_by_clear"]
        if out["workspace_bytes"] is not None:
            out["workspaces_in_a_step"] = out["workspace_bytes"] / one["freed_by_clear"]
    return out


def main() -> None:
    if "--case" in sys.argv:
        print(json.dumps(case(sys.argv[sys.argv.index("--case") + 1])), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="workspace.json")
    ap.add_argument("--limit", type=float, default=60, help="seconds per case")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    out: dict = {"date": time.strftime("%Y-%m-%d"), "model": MODEL, "cases": {}}
    if ns.dry_run:  # no workspace_bytes: calibration.load_workspace refuses this frame as a measurement
        out["dry_run"] = True
    else:
        import torch
        from gpu_constants import _driver

        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --dry-run)")
        out.update(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda)
        out["driver"] = _driver()
        for name in CASES:
            out["cases"][name] = run(name, ns.limit)
            print(name, json.dumps(out["cases"][name]), flush=True)
        out.update(summary(out["cases"]))
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "cases"}), flush=True)


if __name__ == "__main__":
    main()
