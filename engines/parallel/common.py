"""What every data-parallel flavour provides (the GradSync protocol), and shared helpers."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch


class GradSync(Protocol):
    """Turns the gradients of every microbatch into one optimizer update on this rank.

    The schedule calls `microbatch(i, m)` around the forward+backward of microbatch i of m
    (reduction happens only in the last, as DDP's no_sync does), `finish()` once backward is
    over, then `step()`; `memory()` and `pieces()` report after the step.
    """

    def microbatch(self, index: int, count: int) -> AbstractContextManager: ...

    def finish(self) -> None: ...

    def step(self) -> float:
        """Clip by the global norm, update, zero the grads; return the norm before clipping."""

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's persistent 'params', 'grads' and 'optimizer' state."""

    def pieces(self) -> list[dict]:
        """This rank's part of every parameter (see `piece`), for checking against the reference."""


def full_name(p: torch.nn.Parameter, fallback: str) -> str:
    """The parameter's name in the full model (strategies that rename modules set `_lk_name`)."""
    return getattr(p, "_lk_name", fallback)


def piece(name: str, full_shape, values: torch.Tensor, box=None, flat=None) -> dict:
    """A part of a full parameter: `box` is [start, stop) per tensor dim, or `flat` a [start, stop)
    range of the flattened tensor; neither means the whole tensor."""
    return {"name": name, "shape": list(full_shape), "box": box, "flat": flat,
            "values": values.detach().float().cpu().numpy().copy()}


def param_piece(name: str, p: torch.Tensor) -> dict:
    """The piece a (possibly sliced) parameter holds: strategies that slice set `_lk_full_shape`
    and `_lk_box` on it; otherwise it is the whole tensor."""
    shape = getattr(p, "_lk_full_shape", tuple(p.shape))
    return piece(full_name(p, name), shape, p, box=getattr(p, "_lk_box", None))

