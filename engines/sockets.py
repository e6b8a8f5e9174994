"""Which sockets torch listens on in this engine process: gloo's pairs, and the TCPStore on rank 0
(whose listener is closed once the world has formed: engines/rendezvous.py).

That is everything the process listens on, less what the engine itself opened before torch came
(remembered by `remember_engine_listeners`, which host.engine_info calls before the first
process group). Releasing a rank (engines/release.py) shuts the connections made to these.
"""

from __future__ import annotations

import psutil

from labkit.engines import rendezvous

_engine_listeners: frozenset | None = None
"""What this engine listened on before torch did (ipyparallel's own sockets), once known."""


def remember_engine_listeners() -> None:
    """Note what the engine listens on now, before torch does; only the first call counts."""
    global _engine_listeners
    if _engine_listeners is None:
        _engine_listeners = frozenset(all_listening())


def listening() -> list[tuple[str, int]]:
    """(address, port) of every socket torch listens on in this engine, and of the rendezvous
    store it serves after its listener was closed (engines/rendezvous.py)."""
    return sorted((set(all_listening()) - (_engine_listeners or frozenset())) | set(rendezvous.served()))


def all_listening() -> list[tuple[str, int]]:
    """(address, port) of every socket this process listens on."""
    return [
        (plain_ip(c.laddr.ip), c.laddr.port)
        for c in psutil.Process().net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]


def plain_ip(ip: str) -> str:
    """An IPv4 address as itself, also when a dual-stack socket shows it IPv4-mapped (::ffff:a.b.c.d)."""
    return ip[7:] if ip.startswith("::ffff:") else ip
