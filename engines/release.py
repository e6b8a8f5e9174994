"""Releasing a rank: cut its torch connections so that every rank waiting on it is freed at once.

The Lab calls `release(peers)` on each rank whose job is over (labkit/cluster/faults.py), with `peers`
the other engines' listening sockets (engines/sockets.py `listening()`); see engines/runtime.py
for why destroying the process groups alone is not enough.
"""

from __future__ import annotations

import os
import socket

import psutil

from labkit.engines import process_group, runtime, sockets


def release(peers: list | tuple = ()) -> dict:
    """If this rank's job is over, cut it off from the other ranks: every rank still waiting on
    it in a collective gets a connection error at once instead of hanging. Returns the job's state.

    Destroying the process groups closes their connections only if nothing else holds them, and
    PyTorch's DDP does (torch 2.13: once a DistributedDataParallel was built on a gloo group, the
    group outlives destroy_process_group). So the TCP connections themselves are shut down:
    those accepted on this engine's own listeners, and those to `peers` (the other engines'
    listeners, from `sockets.listening()`). The controller's connections are neither, and stay up.

    Returns {"state": the job's state, "held": sockets still listening after the groups were
    destroyed}: nonzero means torch still holds some group (its gloo listeners cannot be shut
    without aborting the process), so the Lab replaces this engine rather than leak its ports."""
    job = runtime.current_job()
    if job.alive:
        return {"state": job.state, "held": 0}
    mine = {port for _, port in sockets.listening()}
    process_group.shutdown_distributed()
    targets = {(ip, port) for ip, port in peers}
    wildcard = {port for ip, port in peers if ip in ("0.0.0.0", "::")}
    for c in psutil.Process().net_connections("inet"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        far = (sockets.plain_ip(c.raddr.ip), c.raddr.port)
        if c.laddr.port in mine or far in targets or far[1] in wildcard:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    return {"state": job.state, "held": len(sockets.listening())}
