"""Where a CUDA op that returns no Work ends, for the collective log (engines/meters/comm.py).

Since torch 2.7 a blocking NCCL collective (async_op=False) runs on the caller's current stream and
ProcessGroupNCCL returns no Work for it (pytorch#148590; its `collective` ends `return asyncOp ? work
: nullptr`, and torch.distributed's Python call, given None, has nothing to wait on): the call returns
once the kernel is queued. The log stamped the op's end at that return, so on the H100 and the H200
(2026-11-26) an all-reduce whose peer never entered it looked left, and the hang was diagnosed as
"in no collective". A StreamMark is an event recorded right after the op on the stream
it ran on; it completes once the GPU has run everything queued there before it, the collective
included. The log polls it as it polls a Work (`CommMeter.sweep`: `is_completed`, `is_success`).
"""

from __future__ import annotations

import torch


class StreamMark:
    """An op's end as the GPU sees it. `query() -> bool`: whether it has completed (a CUDA event's
    `query`, from `after`)."""

    __slots__ = ("is_completed",)

    def __init__(self, query):
        self.is_completed = query

    @classmethod
    def after(cls, tensor) -> StreamMark:
        """Marks the end of what was just queued on `tensor`'s device's current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return cls(event.query)

    def is_success(self) -> bool:
        # a failed NCCL kernel never lets its stream's later events complete: the op stays open, as it should
        return True
