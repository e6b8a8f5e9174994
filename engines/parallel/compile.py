"""Compiled blocks (ParallelConfig.compile): each transformer block's forward through
torch.compile, per block as torchtitan compiles (torchtitan/models/llama3/infra/parallelize.py,
`apply_compile`: "compile each TransformerBlock", so that FSDP's hooks and the pipeline's sends
stay outside the graphs).

torchtitan wraps each block in an OptimizedModule; here the block's bound `forward` is replaced on
the instance instead, so parameter names, the run's ParamMetas and every module hook stay as they
were: hooks run in Module.__call__, around the compiled forward, never inside it (ZeRO-3's and
FSDP's gathers, FSDP2's unshard, the tracker's markers). It runs after tensor, context and expert
parallelism have swapped their layers in (slot 3b of parallelize), so the compiled code is the
rank's own share, and before checkpointing, whose wrapper then calls the compiled forward (a
graph without grad in the forward, with grad in the recomputation).

What dynamo cannot trace inside a block — labkit's TP/CP/EP collectives in their autograd
Functions, MoE's data-dependent token counts — is a graph break: it runs eagerly between graphs,
so the collective log still sees every op. The graphs save other tensors than eager PyTorch
(fused kernels, AOTAutograd's min-cut recomputation); the memory meter's saved-tensor hooks see
what the compiled function saves, so activations are measured as they are, while the theory's
activation bytes stay eager's (tests/test_compile.py measures the difference).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def apply_compile(model: nn.Module) -> tuple[nn.Module, dict]:
    """Compile every block's forward of `model` (in place); returns (model, what was compiled)."""
    for block in model.blocks:
        # dynamic=None: shapes start static and turn dynamic only where they change (MoE's
        # per-expert rows), as torch.compile's default; the blocks share Block.forward's code, so
        # one graph serves every block of a model (parameters are graph inputs, not guards)
        block.forward = torch.compile(block.forward)
    return model, {"blocks": len(model.blocks), "backend": "inductor"}
