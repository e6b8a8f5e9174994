"""The audit beside the comm meter: a TorchDispatchMode that sees every c10d op its thread issues,
so a test can prove that CommMeter (engines/meters/comm.py) missed none. Too slow for the meter
itself (every aten op passes through Python while it is on: 35-130% slower steps, measured)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class CommAudit:
    """A TorchDispatchMode that counts every c10d op issued in its thread (tests use it to prove
    that CommMeter saw each one). Slow: every aten op passes through Python while it is on.
    DTensor ops are handed back (NotImplemented, as PyTorch's CommDebugMode does) so that DTensor
    desugars them first and the mode sees the collectives they turn into."""

    def __init__(self):
        from torch.distributed.tensor import (
            DTensor,  # deferred: the DTensor package is heavy, tests only
        )

        counts: dict[str, int] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if DTensor in types:
                    return NotImplemented
                name = str(func.overloadpacket)
                if "c10d" in name and "wait" not in name and "_wrap" not in name:
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
