"""The per-op checkpointing policy that benchmarks/gpu_constants.py measures is torchtitan's:
in the recomputation no attention kernel runs again, and of a Llama block's seven products only
the second, fourth and sixth (wk, wo, w3) do. The H100 measurement of Nov 2026 ran a list without
cuDNN's SDPA kernel and recomputed the attention; this holds the list to every kernel SDPA picks
(on the CPU, flash_for_cpu)."""

import importlib.util
import os

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))


def _benchmark():
    path = os.path.join(HERE, "..", "benchmarks", "gpu_constants.py")
    spec = importlib.util.spec_from_file_location("gpu_constants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Calls(TorchDispatchMode):
    """Counts aten calls by phase: 'forward' until backward starts, then 'backward'."""

    def __init__(self, kernels):
        super().__init__()
        self.kernels, self.phase = kernels, "forward"
        self.calls = {"forward": {"sdpa": 0, "mm": 0}, "backward": {"sdpa": 0, "mm": 0}}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.kernels:
            self.calls[self.phase]["sdpa"] += 1
        elif func == torch.ops.aten.mm.default:
            self.calls[self.phase]["mm"] += 1
        return func(*args, **(kwargs or {}))


def _count(mode: str) -> dict:
    bench = _benchmark()
    torch.manual_seed(0)
    h, heads, kv, f, seq = 64, 4, 2, 128, 16
    block = bench.Block(h, heads, kv, f)
    if mode != "none":
        bench.checkpointed(block, mode)
    hd = h // heads
    freqs = torch.polar(torch.ones(seq, hd // 2), torch.randn(seq, hd // 2))
    x = torch.randn(2, seq, h, requires_grad=True)
    counter = _Calls(bench.SDPA_KERNELS)
    # early stop would end the recomputation at the last saved tensor (w2's output is never one)
    with counter, torch.utils.checkpoint.set_checkpoint_early_stop(False):
        y = block(x, freqs)
        counter.phase = "backward"
        y.sum().backward()
    return counter.calls


def test_the_op_policy_keeps_the_attention_and_every_other_product():
    none, full, op = _count("none"), _count("full"), _count("op")
    assert none["forward"] == {"sdpa": 1, "mm": 7}
    assert full["backward"]["sdpa"] == 1 and full["backward"]["mm"] == none["backward"]["mm"] + 7, full
    assert op["forward"] == none["forward"]
    assert op["backward"]["sdpa"] == 0, f"the op policy recomputed the attention: {op}"
    assert op["backward"]["mm"] == none["backward"]["mm"] + 3, op


def test_the_host_cost_benchmark_counts_more_calls_under_the_policy(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(HERE, "..", "benchmarks"))
    import op_policy_host

    none, op = op_policy_host.host_seconds(2, "none", repeats=1), op_policy_host.host_seconds(2, "op", repeats=1)
    assert none[0] > 0 and op[0] > 0
    assert op[1] > none[1], (none, op)  # the recomputation's calls
