"""What a rank really ran in fp8: every `aten::_scaled_mm` it executes, counted per step and direction.

A run that says precision='fp8' but converted nothing computes in bf16, and its losses sit within fp8's
error of the fp8 reference's: no bound on the numbers tells the two apart. The count does. Every fp8
matmul of a training step reaches the dispatcher as `aten::_scaled_mm` — labkit's own Float8Matmul
(engines/float8.py), torchao's Float8Linear under FSDP2 and its float8 TP styles alike — so one small
Python kernel at the BackendSelect key (ahead of autograd's and the backends', as the comm meter's:
engines/meters/comm.py says why that key) counts them all and re-dispatches. Only this op pays for it.

Forward or backward: a call made while autograd's engine runs a graph task is the backward's (its task id
is -1 elsewhere; grad mode cannot tell, since a custom Function's forward runs with it off too). The oracle
holds each rank's counts to what its layout converts (labkit/oracle/float8.py): three per converted linear
and microbatch (output, input gradient, weight gradient), torchao's float8 training.
"""

from __future__ import annotations

import torch

_LIBS: list = []  # the registration lives as long as this Library object


class Float8Count:
    """Per step: {'forward': n, 'backward': n} of `_scaled_mm` calls while this count is current."""

    current: Float8Count | None = None

    def __init__(self):
        self.steps: list[dict[str, int]] = []

    def begin_step(self) -> None:
        self.steps.append({"forward": 0, "backward": 0})

    def __enter__(self):
        install()
        Float8Count.current = self
        return self

    def __exit__(self, *exc):
        Float8Count.current = None


def _kernel(keyset, *args, **kwargs):
    count = Float8Count.current
    if count is not None and count.steps:
        count.steps[-1]["forward" if torch._C._current_graph_task_id() == -1 else "backward"] += 1
    return _REDISPATCH(keyset.remove(torch._C.DispatchKey.BackendSelect), *args, **kwargs)


_REDISPATCH = torch.ops.aten._scaled_mm.default._handle.redispatch_boxed


def install() -> None:
    """Register the counting kernel once per process (a pass-through while no count is current)."""
    if _LIBS:
        return
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("_scaled_mm", _kernel, "BackendSelect", with_keyset=True)
    _LIBS.append(aten)
