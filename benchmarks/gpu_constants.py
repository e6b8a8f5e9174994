"""The hardware constants the time and memory models cite (labkit/theory/planner/hardware.py), measured on
one GPU: matrix products (bf16 and fp8) by shape, flash attention forward and backward, HBM
copies, the CUDA context, and one torchtitan-style Llama step under FSDP2 (a world of one) with
its allocator's allocated and reserved peaks, for each activation-checkpointing mode.

    python benchmarks/gpu_constants.py            # on a machine with a CUDA GPU; prints JSON
    python benchmarks/gpu_constants.py --tiny     # the same code on the CPU, tiny shapes (a smoke test)

Timings are CUDA events around each op after warm-up (median of the repeats), no synchronize
between the ops being timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def _driver() -> str:
    """The NVIDIA driver's version, as nvidia-smi reports it ('' without one)."""
    import subprocess

    try:
        got = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return ""
    return got.stdout.strip().splitlines()[0] if got.returncode == 0 and got.stdout.strip() else ""


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of fn() (CUDA events; perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmuls(dev, shapes) -> list[dict]:
    """bf16 products (M, K, N) and, where the GPU has fp8 tensor cores, torch._scaled_mm in e4m3
    with per-tensor scales (torchao's float8 training recipe)."""
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        t = timed(lambda a=a, b=b: a @ b)
        row = {"M": m, "K": k, "N": n, "bf16_tflops": 2 * m * k * n / t / 1e12}
        if dev == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
            one = torch.ones((), device=dev)
            t8 = timed(lambda a8=a8, b8=b8, one=one: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
            row["fp8_tflops"] = 2 * m * k * n / t8 / 1e12
        out.append(row)
    return out


def attention(dev, cases) -> list[dict]:
    """Causal scaled_dot_product_attention (the flash kernel on the GPU), forward and
    forward + backward; FLOPs counted as computed: 4·b·s²·h/2 forward, 2.5 times that backward."""
    out = []
    for b, heads, kv, s, hd in cases:
        q = torch.randn(b, heads, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, kv, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, kv, s, hd, device=dev, dtype=torch.bfloat16, requires_grad=True)

        def fwd(q=q, k=k, v=v, gqa=kv != heads):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        y = fwd()
        g = torch.randn_like(y)
        t_f = timed(fwd)
        t_fb = timed(lambda fwd=fwd, g=g: torch.autograd.backward(fwd(), g))
        flops = 4 * b * s * s * heads * hd / 2
        out.append(
            {
                "b": b,
                "heads": heads,
                "kv_heads": kv,
                "s": s,
                "hd": hd,
                "fwd_tflops": flops / t_f / 1e12,
                "fwd_bwd_tflops": 3.5 * flops / t_fb / 1e12,
            }
        )
    return out


def bandwidth(dev, n: int) -> dict:
    """Bytes read + written per second by a copy and by an elementwise add."""
    a = torch.empty(n, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    c = torch.empty_like(a)
    t_copy = timed(lambda: b.copy_(a))
    t_add = timed(lambda: torch.add(a, b, out=c))
    return {"copy_TBps": 2 * 2 * n / t_copy / 1e12, "add_TBps": 3 * 2 * n / t_add / 1e12}


# a torchtitan-style Llama (eager): RMSNorm upcast to fp32, complex RoPE, GQA via SDPA, SwiGLU,
# the loss on fp32 logits
class RMSNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope(x, freqs):
    # (b, s, nh, hd) -> complex (b, s, nh, hd/2) times (s, hd/2) -> (b, s, nh, hd)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, h, heads, kv, f):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, h // heads
        self.attention_norm, self.ffn_norm = RMSNorm(h), RMSNorm(h)
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, kv * self.hd, bias=False)
        self.wv = nn.Linear(h, kv * self.hd, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.w1 = nn.Linear(h, f, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        y = self.attention_norm(x)
        q = rope(self.wq(y).view(b, s, self.heads, self.hd), freqs).transpose(1, 2)
        k = rope(self.wk(y).view(b, s, self.kv, self.hd), freqs).transpose(1, 2)
        v = self.wv(y).view(b, s, self.kv, self.hd).transpose(1, 2)
        rep = self.heads // self.kv  # torchtitan's repeat_kv: SDPA sees (and saves) every head's k, v
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, layers, h, heads, kv, f, vocab, seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Block(h, heads, kv, f) for _ in range(layers))
        self.norm = RMSNorm(h)
        self.output = nn.Linear(h, vocab, bias=False)
        hd = h // heads
        inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("freqs", torch.polar(torch.ones(seq, hd // 2), torch.outer(torch.arange(seq), inv)))

    def forward(self, tokens, targets):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs)
        logits = self.output(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# torchtitan's op-level selective AC keeps the outputs of these ops (its _op_sac_save_list, which
# names every SDPA kernel: on an H100 with torch >= 2.10 and cuDNN > 9.15 SDPA runs cuDNN's, and
# before this list named it the 'op' measurement recomputed the attention; flash_for_cpu is the
# CPU's kernel, so that --tiny and tests/test_op_policy.py check the same policy)
SDPA_KERNELS = tuple(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
)
SAVE = frozenset((torch.ops.aten.mm.default, torch.ops.aten.max.default, *SDPA_KERNELS))


def checkpointed(block, mode):
    """Wrap a block's forward in torch.utils.checkpoint: 'full', or torchtitan's 'op' policy
    (keep mm outputs except every second one, and the attention's)."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    inner = block.forward
    if mode == "full":
        block.forward = lambda x, f: checkpoint(inner, x, f, use_reentrant=False)
        return

    def contexts():
        count = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            mode_ = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                count[mode_] += 1
            keep = func in SAVE and not (func == torch.ops.aten.mm.default and count[mode_] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    block.forward = lambda x, f: checkpoint(inner, x, f, use_reentrant=False, context_fn=contexts)


def llama_step(dev, shape: dict, ac: str, steps: int) -> dict:
    """FSDP2 (fully_shard per block and on the root, bf16 params, fp32 reduce) on a world of one,
    AdamW (fused): peak allocated and reserved bytes, the steady step time."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
        dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(**{k: shape[k] for k in ("layers", "h", "heads", "kv", "f", "vocab", "seq")})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if ac != "none":
            checkpointed(block, ac)
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(model.layers) - 1)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    b, s, v = shape["b"], shape["seq"], shape["vocab"]
    tokens = torch.randint(0, v, (b, s), device=dev)

    def step():
        loss = model(tokens, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = timed(step, repeats=steps, warmup=1)
    stats = torch.cuda.memory_stats() if dev == "cuda" else {}
    params = sum(p.numel() for p in model.parameters())
    return {
        **shape,
        "ac": ac,
        "params": params,
        "step_s": t,
        "tokens_per_s": b * s / t,
        "allocated_peak": stats.get("allocated_bytes.all.peak", 0),
        "reserved_peak": stats.get("reserved_bytes.all.peak", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: checks the code runs")
    p.add_argument("--llama-only", action="store_true", help="only the Llama steps")
    ns = p.parse_args()
    dev = "cpu" if ns.tiny or not torch.cuda.is_available() else "cuda"
    out: dict = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "cuda": torch.version.cuda}
    if dev == "cuda":
        out["driver"] = _driver()
        # torch.cuda.nccl.version() is the NCCL torch was built with; the loaded one can differ
        # (LD_PRELOAD, scripts/gpu-check.sh): record both
        from labkit.engines.host import nccl_version

        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        out["nccl_loaded"] = ".".join(map(str, nccl_version() or ()))
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info()
        torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # cuBLAS handle
        free2, _ = torch.cuda.mem_get_info()
        out["device"] = torch.cuda.get_device_name()
        out["total_bytes"] = total
        out["context_bytes"] = total - free2 - torch.cuda.memory_reserved()
        out["context_bytes_before_cublas"] = total - free
    if ns.tiny:
        shapes, cases, n = [(64, 64, 64)], [(1, 4, 2, 64, 16)], 1 << 16
        llama = {"layers": 2, "h": 64, "heads": 4, "kv": 2, "f": 128, "vocab": 256, "seq": 64, "b": 2}
    else:
        shapes = [
            (8192, 8192, 8192),
            (8192, 4096, 14336),  # 8B's w1 at b·s = 8192 tokens
            (8192, 14336, 4096),  # 8B's w2
            (8192, 4096, 1024),  # 8B's wk (GQA)
            (8192, 4096, 128256),  # 8B's LM head
            (2048, 2048, 2048),
            (1024, 1024, 1024),
        ]
        cases = [
            (2, 32, 32, 8192, 128),
            (8, 32, 32, 2048, 128),
            (1, 64, 64, 8192, 128),
            (4, 16, 16, 4096, 64),
            (2, 32, 8, 8192, 128),
        ]
        n = 1 << 29
        llama = {"layers": 16, "h": 2048, "heads": 32, "kv": 8, "f": 8192, "vocab": 128256, "seq": 4096, "b": 2}
    if not ns.llama_only:
        out["matmul"] = matmuls(dev, shapes)
        print(json.dumps(out["matmul"]), flush=True)
        out["attention"] = attention(dev, cases)
        print(json.dumps(out["attention"]), flush=True)
        out["bandwidth"] = bandwidth(dev, n)
    out["llama"] = []
    for ac in ("none", "full", "op"):
        out["llama"].append(llama_step(dev, llama, ac, steps=3 if ns.tiny else 8))
        print(json.dumps(out["llama"][-1]), flush=True)
        gc.collect()  # FSDP's modules hold reference cycles: the last model's memory goes only now
        if dev == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(out, indent=1)
    print(text)
    if os.environ.get("OUT"):
        name = "gpu_llama.json" if ns.llama_only else "gpu_constants.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
