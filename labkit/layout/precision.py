"""Bytes per element in each precision, as the engines lay tensors out (engines/precision.py
holds the torch dtypes of the same choice): the theory multiplies element counts by these.
"""

from __future__ import annotations

ELEM = {"fp32": 4, "bf16": 2, "fp8": 2}
"""Bytes per compute element: parameters, gradients, activations, gathered parameters, and the
activations and gradients a pipeline passes between stages. fp8 training (torchao's float8) keeps
all of these in bf16: only the linear layers' matmul operands are cast to fp8, per call."""
GATHER = {"fp32": 4, "bf16": 2, "fp8": 1}
"""Bytes per element of a parameter all-gather (FSDP / ZeRO-3): fp8 training gathers the weights
already cast to fp8 (torchao's enable_fsdp_float8_all_gather), half of bf16's traffic."""
REDUCE = 4
"""Bytes per element of a gradient reduction: fp32 in both precisions (engines/precision.py)."""

LOSS_CHUNK = 2**24
"""Logits a fused cross-entropy (ModelConfig.loss='fused') takes to fp32 at a time, forward and
backward (64 MiB): its only fp32 buffer the size of the logits' rows (engines/loss.py)."""
