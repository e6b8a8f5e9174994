"""Run on an engine (through Lab.apply): facts about its device. Imports torch only when called,
and never torch.distributed."""

from __future__ import annotations


def total_memory() -> int:
    """Bytes of this engine's GPU (the memory figure's capacity line)."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
