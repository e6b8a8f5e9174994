"""The memory meter: model-state bytes by category, and activations saved for backward.

Model states are counted in unique storages, so a flat buffer that backs many gradient views
is counted once, and a parameter that is a view of a bigger buffer counts the whole buffer
(that is what it holds). Activations are the tensors autograd saves for backward, seen through
`torch.autograd.graph.saved_tensors_hooks`: live bytes rise at each save and fall when the
graph releases the saved tensor, and the peak over the step is kept — so GPipe's m
microbatches in flight and 1F1B's at most p show up. Saved tensors that are parameters (a
Linear saves its weight) are not activations and are skipped. A tensor subclass is counted by the
plain tensors inside it (`plain`): an fp8 tensor's one-byte values and its scale, not the size
its wrapper reports in its nominal dtype.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (DTensor TP), else `t` itself."""
    # DTensor's package is not imported for this: ~45 MB per engine that runs none (labkit's own
    # strategies); while it is not loaded, no tensor is a DTensor
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t._local_tensor if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s values: a DTensor's local shard, a wrapper subclass's inner
    tensors (torchao's Float8TrainingTensor: its fp8 bytes and its fp32 scale; its FSDP weight
    wrapper: the weight), else `t`. A wrapper's own storage has its nominal dtype's size, not theirs."""
    t = local(t)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in plain(getattr(t, n))]
    return [t]


def storage_key(t: torch.Tensor) -> int:
    """The storage object behind `t` (its StorageImpl), not its address: ZeRO-3 and FSDP free a
    gathered parameter's buffer and re-allocate it in place (storage.resize_), and fake tensors
    (the dry run) all have address 0."""
    return local(t).untyped_storage()._cdata


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries are skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        for x in plain(t):
            seen[storage_key(x)] = x.untyped_storage().nbytes()
    return sum(seen.values())


class _Saved:
    """What the pack hook hands to autograd: holds the tensor; releasing it lowers the count."""

    __slots__ = ("tensor", "meter", "keys")

    def __init__(self, tensor, meter, keys):
        self.tensor, self.meter, self.keys = tensor, meter, keys

    def __del__(self):
        for key in self.keys:
            self.meter._release(key)


class MemoryMeter:
    """Live and peak bytes per category on one rank.

    `activations` is driven by the saved-tensor hooks; strategies may track other transient
    categories (ZeRO-3's gathered parameters: `track("gathered", +n)`). `peak` is the largest
    sum of the persistent model states (set once per step by `set_states`) and every live
    transient category; on CUDA the report uses the allocator's max_memory_allocated instead.
    """

    def __init__(self):
        self.live: dict[str, int] = {}
        self.peak_of: dict[str, int] = {}
        self.states = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage -> [bytes, count]
        self._exclude: set[int] = set()  # storage objects (_cdata)

    def exclude(self, tensors) -> None:
        """Add storages that are not activations (parameters, their flat buffers). Keyed by the
        storage object, not its address: ZeRO-3 and FSDP free a gathered parameter buffer after use
        and re-allocate it in place (storage.resize_), and it must stay a parameter."""
        self._exclude |= {storage_key(x) for t in tensors if t is not None for x in plain(t)}

    def set_states(self, nbytes: int) -> None:
        self.states = nbytes
        self._update_peak()

    def track(self, category: str, delta: int) -> None:
        self.live[category] = self.live.get(category, 0) + delta
        self.peak_of[category] = max(self.peak_of.get(category, 0), self.live[category])
        self._update_peak()

    def _update_peak(self) -> None:
        self.peak = max(self.peak, self.states + sum(self.live.values()))

    def reset_peaks(self) -> None:
        self.peak_of = dict(self.live)
        self.peak = self.states + sum(self.live.values())

    # -- saved tensors ------------------------------------------------------------------------
    def saved_tensors(self):
        """Context manager: count what autograd saves inside it as activations."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        keys = []
        for x in plain(t):
            key, nbytes = storage_key(x), x.untyped_storage().nbytes()
            if key in self._exclude or nbytes == 0:
                continue
            keys.append(key)
            ref = self._refs.get(key)
            if ref is None:
                self._refs[key] = [nbytes, 1]
                self.track("activations", nbytes)
            else:
                ref[1] += 1
        if not keys:
            return t
        # detached: a node that saves its own output would otherwise hold, through this object, the
        # tensor whose grad_fn is that node; a cycle through C++ that Python's collector cannot see,
        # broken only when backward releases the node's variables, never under retain_graph (a
        # split backward's B keeps the graph for W: engines/parallel/pipeline/split_backward.py)
        return _Saved(t.detach(), self, keys)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[1] -= 1
        if ref[1] == 0:
            del self._refs[key]
            self.track("activations", -ref[0])
