"""Point-to-point that gloo and NCCL both run: ring attention's hops and the pipeline's batches.

Two rules, each from a way the naive isend/irecv pair fails on a GPU:
  - Every set of sends and receives that must progress together goes out as one
    `dist.batch_isend_irecv` (one NCCL group call), as Megatron-LM and torch.distributed.pipelining
    do. Under NCCL an unbatched send blocks until its receive runs, and once a group is eagerly
    initialized (init_process_group(device_id=...)) PyTorch serializes unbatched p2p with every
    other op of the group (PRs #129147, #132900): ring attention's irecv-then-isend on every rank
    would wait forever at the first hop. (labkit/layout/simulator.py models these rules.)
  - Gloo has no send/recv for CUDA tensors (torch.distributed's backend table; ProcessGroupGloo
    hands the device pointer to its TCP transport: 'writev ... Bad address' or a segfault,
    pytorch issue #45995). On a gloo group CUDA tensors are staged through pinned host buffers: a
    send is copied to the host before it is posted, a receive lands on the host and is copied to
    the device when it is waited for. That is what ranks sharing one GPU (device='cuda') need.
The comm meter sees the same send/recv ops either way (staged ones as host tensors, same bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Exchange:
    """The works of one batch. `wait_recvs()` before reading what it received (under NCCL the
    batch is one work, so this waits for its sends too — on the device stream, not the host);
    `wait()` before the sent tensors may be changed or the step ends. Each work is waited for
    once: a gloo receive waited for twice waits for a second message."""

    def __init__(self, works: list, ops: list, n_recvs: int, copies: list):
        self.works, self.ops, self.n_recvs, self.copies = works, ops, n_recvs, copies
        self._waited = [False] * len(works)

    def _wait(self, indices) -> None:
        for i in indices:
            if not self._waited[i]:
                self.works[i].wait()
                self._waited[i] = True

    def wait_recvs(self) -> None:
        per_op = len(self.works) == len(self.ops)  # gloo: one work per op; NCCL: one for the group
        self._wait(range(self.n_recvs if per_op else len(self.works)))
        for device_buf, host_buf in self.copies:
            device_buf.copy_(host_buf)
        self.copies = []

    def wait(self) -> None:
        self.wait_recvs()
        self._wait(range(len(self.works)))


class Link:
    """Point-to-point on one process group: batches of sends and receives, staged through host
    memory where the backend cannot read device memory (gloo)."""

    def __init__(self, group):
        self.group = group
        self.host_only = dist.get_backend(group) == "gloo"

    def batch(self, sends=(), recvs=()) -> Exchange:
        """Post `recvs` [(buffer, peer, tag)] and `sends` [(tensor, peer, tag)] (peers are global
        ranks; NCCL ignores tags, gloo matches by them) as one batch_isend_irecv. The receives go
        first, so that gloo has their buffers when the peers' data comes."""
        ops, copies = [], []
        for buf, peer, tag in recvs:
            if self.host_only and buf.is_cuda:
                host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                copies.append((buf, host))
                buf = host
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, tag))
        for t, peer, tag in sends:
            if self.host_only and t.is_cuda:  # gloo reads host memory only
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                t = host.copy_(t)  # synchronous: the device's value, copied before it is posted
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, self.group, tag))
        return Exchange(dist.batch_isend_irecv(ops), ops, len(recvs), copies)
