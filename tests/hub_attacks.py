"""What student B's kernel tries against student A's Lab: tests/test_classroom_hub.py sends this
file's source to B's kernel (a notebook cell, run as B), then calls these functions there. Each
returns what B got; the test judges each attack by what it did to A (a key B wrote that A's ranks
read, A's output in B's hands, a connection A's rank accepted from B, a file of A's B read).

Where B finds A's ports: /proc/net/tcp lists every TCP socket of B's network namespace with its
owner's uid, readable by every user; on a shared 127.0.0.1 that includes every Lab's.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

WRITTEN = "written-by-student-b"
"""The key B writes into every rendezvous store it reaches (A's ranks look for it: `store.check`)."""


def listening_ports(uid: int) -> list[int]:
    """The TCP ports that processes of `uid` listen on, as this network namespace's /proc/net shows them."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and int(f[7]) == uid:  # 0A: LISTEN; f[7]: the socket's owner
                out.add(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(out)


class StoreCatcher:
    """Watch for every new listening port of `uid` and try each as torch's TCPStore (no
    authentication): one that answers is kept, read (list_keys) and written (WRITTEN), and stays
    B's after the store stops listening (labkit closes the listener once the ranks have joined,
    engines/rendezvous.py; connections made before stay served)."""

    def __init__(self, uid: int, seconds: float = 300.0):
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # a ZMQ port refuses the store's handshake, loudly
        import torch.distributed  # noqa: F401  (loaded now: the store listens for under a second)

        self.uid, self.seconds = uid, seconds
        self.seen_ports: set[int] = set()
        self.caught: dict[int, object] = {}
        self.keys: dict[int, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        known = set(listening_ports(self.uid))
        self.seen_ports |= known
        end = time.monotonic() + self.seconds
        while not self._stop.is_set() and time.monotonic() < end:
            now = set(listening_ports(self.uid))
            for port in now - known:  # each new port at once, in a thread: the store listens briefly
                threading.Thread(target=self._try, args=(port,), daemon=True).start()
            known |= now
            self.seen_ports |= now
            time.sleep(0.002)

    def _try(self, port: int) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
            store.set(WRITTEN, "student B was here")
            self.caught[port] = store
        except Exception:  # not a store (ipyparallel's ports, gloo's), or gone
            pass

    def report(self) -> dict:
        """Stop watching; what B saw and holds: A's listening ports, the stores B caught and their keys."""
        self._stop.set()
        self._thread.join(10)
        time.sleep(2.5)  # tries still running end within their 2 s timeout
        for port, store in self.caught.items():
            self.keys[port] = sorted(store.list_keys())
        return {"ports_seen": sorted(self.seen_ports), "stores": sorted(self.caught), "keys": self.keys}


def knock(ports: list[int], hosts: list[str], seq: int = 1 << 40) -> dict:
    """Connect to each (host, port) and send gloo's 8-byte sequence number (gloo's listener files an
    incoming connection under the number it reads, unauthenticated: gloo/transport/tcp/listener.cc).
    Keeps the connections open (in KNOCKS); returns host:port -> B's local port, or the error."""
    out = {}
    for host in hosts:
        for port in ports:
            try:
                s = socket.create_connection((host, port), timeout=3)
                s.sendall(struct.pack("<q", seq))
                KNOCKS.append(s)
                out[f"{host}:{port}"] = s.getsockname()[1]
            except OSError as e:
                out[f"{host}:{port}"] = f"{type(e).__name__}: {e.strerror or e}"
    return out


KNOCKS: list[socket.socket] = []


class Listener:
    """ZMQ SUB sockets on (host, port): a PUB socket (ipyparallel's iopub, a Jupyter kernel's
    iopub) sends what it publishes to every subscriber, without a key."""

    def __init__(self, ports: list[int], hosts: list[str]):
        import zmq

        self.ctx = zmq.Context()
        self.subs = {}
        for host in hosts:
            for port in ports:
                s = self.ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://{host}:{port}")
                self.subs[f"{host}:{port}"] = s

    def heard(self, marker: str, seconds: float) -> dict:
        """For `seconds`: messages per endpoint, and the endpoints whose messages carried `marker`."""
        import zmq

        poller = zmq.Poller()
        for s in self.subs.values():
            poller.register(s, zmq.POLLIN)
        by_socket = {s: k for k, s in self.subs.items()}
        count, carried = {}, set()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for s, _ in poller.poll(100):
                parts = s.recv_multipart()
                key = by_socket[s]
                count[key] = count.get(key, 0) + 1
                if any(marker.encode() in p for p in parts):
                    carried.add(key)
        for s in self.subs.values():
            s.close()
        self.ctx.term()
        return {"messages": count, "carried_marker": sorted(carried)}


def read(paths: list[str]) -> dict:
    """Try to read each path (a file, or a directory's listing): path -> bytes read, or the error."""
    out = {}
    for p in paths:
        try:
            if os.path.isdir(p):
                out[p] = f"listed {len(os.listdir(p))} entries"
            else:
                with open(p, "rb") as f:
                    out[p] = f"read {len(f.read())} bytes"
        except OSError as e:
            out[p] = type(e).__name__
    return out
