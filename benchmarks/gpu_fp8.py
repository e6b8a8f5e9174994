"""FP8 training on the GPU (built and checked on the CPU first): its layouts at world 2 over
NCCL (two ranks sharing one GPU), each held by the oracle in its reference's arithmetic (torchao's
Float8Linear on one process: labkit/oracle/arithmetic.py; a GPU's kernels are not the CPU's, so the
counted fp8 bounds of labkit/oracle/bounds_fp8.py).
On a Hopper GPU torch._scaled_mm runs the fp8 tensor cores, where the CPU emulated them.

    python benchmarks/gpu_fp8.py --out fp8.json            # on a CUDA GPU (torchao in the environment)
    python benchmarks/gpu_fp8.py --cpu --out fp8.json      # the same on gloo, CPU
    python benchmarks/gpu_fp8.py --dry-run --out fp8.json  # arguments and the file's frame only

Llama 3.2 1B's tokens/s in fp8 against bf16 is benchmarks/gpu_mfu.py's (`--precisions bf16 fp8`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

LAYOUTS = {
    "ddp": dict(dp=2),
    "fsdp": dict(dp=2, sharding="fsdp"),
    "fsdp2": dict(dp=2, sharding="fsdp", impl="torch"),
    "tp+sp": dict(tp=2, sequence_parallel=True),
    "pp 1f1b": dict(pp=2, microbatches=2),
    "ddp rowwise": dict(dp=2, fp8_recipe="rowwise"),
}
"""tests/test_fp8.py's layouts at world 2 (there at world 4 on the CPU cluster)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8.json")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks the script runs")
    ap.add_argument("--dry-run", action="store_true", help="parse, write the file's frame, run nothing")
    ns = ap.parse_args()
    out: dict = {"layouts": []}

    def save():
        with open(ns.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    if ns.dry_run:
        out["dry_run"] = True
        return save()
    import torch
    from gpu_layouts import GPT

    from labkit import Lab, ParallelConfig, reference
    from labkit.oracle.checks import margins, mismatches

    if not ns.cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu)")
    device = "cpu" if ns.cpu else "cuda"
    out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    refs: dict = {}
    with Lab(engines=2, device=device, progress=False, timeout=120) as lab:
        out.update(backend=lab.backend, backend_reason=lab.backend_reason)
        for name in ns.layouts:
            cfg = ParallelConfig(precision="fp8", **LAYOUTS[name])
            row = {"layout": name, "config": cfg.to_dict()}
            t0 = time.monotonic()
            try:
                res = lab.run(cfg, model=GPT, steps=3, return_params=True, timeout=60)
                if "ref" not in refs:  # the oracle replays it in the run's own arithmetic (labkit/oracle/arithmetic.py)
                    refs["ref"] = reference(GPT, steps=3)
                found = mismatches(res, refs["ref"])
                row.update(ok=not found, mismatches=[str(m) for m in found], margins=margins(res, refs["ref"]))
                row["step_ms"] = [1e3 * t for t in res.ranks[0].step_times]
            except Exception as e:  # noqa: BLE001 - a row records what failed and the next one runs
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            row["seconds"] = round(time.monotonic() - t0, 2)
            said = json.dumps(row.get("margins") or row.get("error"))[:300]
            print(f"fp8 {name:<12} {'ok ' if row['ok'] else 'FAIL'} {said}", flush=True)
            out["layouts"].append(row)
            save()
    out["summary"] = {"ok": sum(r["ok"] for r in out["layouts"]), "layouts": len(out["layouts"])}
    save()
    print(json.dumps(out["summary"]), flush=True)


if __name__ == "__main__":
    main()
