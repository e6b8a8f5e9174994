"""Closing the rendezvous store's listener once the world has formed.

torch's TCPStore has no authentication: whoever connects can read and write the keys every rank
trusts. It is needed while the ranks meet (each rank's client connects then) and afterwards only
through those connections. `seal` closes the listening socket the store was given
(process_group.open_rendezvous's, passed as master_listen_fd) and leaves the store serving the
connections it has. A socket shut down under libuv's event loop makes accept() fail forever (a
busy loop), so the socket is not shut down: a fresh unbound socket takes its descriptor number
(dup2), which drops the last reference to the listening one, the kernel closes it, and its port is
free; libuv still owns the number and closes it with the store.

The store's port still names its connections: releasing a rank (engines/release.py) cuts them as
it cuts gloo's, so `served()` reports the sealed endpoint beside what torch listens on.
"""

from __future__ import annotations

import os
import socket

_served: tuple[str, int] | None = None
"""The sealed store's (address, port) while it lives; this process's one store."""


def seal(listen_fd: int, endpoint: tuple[str, int]) -> None:
    """Stop the store that listens on `listen_fd` (at `endpoint`) from accepting connections; it
    keeps serving the ones it has."""
    global _served
    blank = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        os.dup2(blank.fileno(), listen_fd)
    finally:
        blank.close()
    _served = endpoint


def served() -> list[tuple[str, int]]:
    """The sealed store's endpoint, if this process serves one."""
    return [_served] if _served else []


def forget() -> None:
    """The store is gone (process_group.shutdown_distributed)."""
    global _served
    _served = None
