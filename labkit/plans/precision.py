"""Bytes per element in each precision, as the engines lay tensors out (engines/precision.py
holds the torch dtypes of the same choice): the theory multiplies element counts by these.
"""

from __future__ import annotations

ELEM = {"fp32": 4, "bf16": 2}
"""Bytes per compute element: parameters, gradients, activations, gathered parameters, and the
activations and gradients a pipeline passes between stages."""
REDUCE = 4
"""Bytes per element of a gradient reduction: fp32 in both precisions (engines/precision.py)."""
