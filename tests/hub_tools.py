"""A real JupyterHub for tests/test_classroom_hub.py: Unix users the test creates, the hub and its
proxy (configurable-http-proxy from npm) started as a teacher would start them, and the students'
kernels driven through the hub's REST API and the Jupyter server's websocket, as a browser does.

Students must be able to run the Python the hub runs. Where it lives under a directory other users
cannot enter (a pyenv under /root, 0700; a clone in a private home), the hub runs in a mount
namespace of its own in which those directories are entered by anyone (a tmpfs of mode 0755 whose
entries are bind mounts of the originals, each keeping its own mode): nothing on the machine
changes, and the view goes with the hub's last process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLASSROOM = ROOT / "classroom"
CHP = "configurable-http-proxy"
START_S = 240.0
"""Bound on a hub, a server or a stop coming up or down (a loaded 2-core machine is slow)."""


def need_hub() -> str:
    """The proxy's path; skips (fails in CI: LABKIT_REQUIRE_CLUSTER_TOOLS) where a tool is missing."""
    missing = []
    for module, pkg in (("jupyterhub", "jupyterhub==6.1.1"), ("jupyterhub_idle_culler", "jupyterhub-idle-culler")):
        try:
            __import__(module)
        except ImportError:
            missing.append(f"{pkg} (pip)")
    missing += [
        f"{t} (apt)"
        for t in ("ip", "nft", "unshare", "nsenter", "ipcmk", "useradd", "userdel", "runuser")
        if not shutil.which(t)
    ]
    chp = shutil.which(CHP) or ""
    if not chp:
        missing.append(f"{CHP} (npm install -g {CHP})")
    why = f"needs {', '.join(missing)}; .ci/run installs them" if missing else ""
    if not why and os.geteuid() != 0:
        why = "needs root (Unix users, network namespaces, a hub that spawns as other users)"
    if why:
        if os.environ.get("LABKIT_REQUIRE_CLUSTER_TOOLS"):
            pytest.fail(why + ": CI must run this test")
        pytest.skip(why)
    return chp


# -- the students ---------------------------------------------------------------------------------
class Students:
    """Unix users lk<tag>a, lk<tag>b, ... in group lk<tag>, homes as Debian's useradd makes them
    (/home/NAME, 0755); `remove` ends every process they still have and deletes them."""

    def __init__(self, n: int):
        self.tag = uuid.uuid4().hex[:5]
        self.group = f"lk{self.tag}"
        self.names = [f"lk{self.tag}{chr(ord('a') + k)}" for k in range(n)]
        try:
            _run(["groupadd", self.group])
            for name in self.names:
                _run(["useradd", "-m", "-s", "/bin/bash", "-G", self.group, name])
                os.chmod(self.home(name), 0o755)  # Debian 12's default (HOME_MODE unset, UMASK 022)
        except BaseException:
            self.remove()
            raise

    def uid(self, name: str) -> int:
        import pwd

        return pwd.getpwnam(name).pw_uid

    def home(self, name: str) -> str:
        return f"/home/{name}"

    def processes(self, name: str) -> list[psutil.Process]:
        uid = self.uid(name)
        out = []
        for p in psutil.process_iter(["uids"]):
            if p.info["uids"] and p.info["uids"].real == uid:
                out.append(p)
        return out

    def end_processes(self, name: str) -> list[str]:
        """End what `name` still runs (processes this test started through the hub); what it was.
        SIGTERM first, then SIGKILL to whatever runs as them, scanned again until nothing does: a
        process that forks on SIGTERM (one of the test's attacks) is gone from the first list."""
        left = self.processes(name)
        seen = [_named(p) for p in left]
        for p in left:
            with _quiet():
                p.terminate()
        psutil.wait_procs(left, timeout=3)
        deadline = time.monotonic() + 30
        while (left := self.processes(name)) and time.monotonic() < deadline:
            seen += [_named(p) for p in left]
            for p in left:
                with _quiet():
                    p.kill()
            psutil.wait_procs(left, timeout=3)
        return seen

    def remove(self) -> None:
        for name in self.names:
            try:
                self.end_processes(name)
            except KeyError:  # never made
                continue
            subprocess.run(["userdel", "-r", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", self.group], capture_output=True, timeout=60)


# -- what students must be able to run ------------------------------------------------------------
def closed_dirs(paths) -> list[str]:
    """The directories on the way to `paths` that other users cannot enter (no o+x), outermost first."""
    out: list[str] = []
    for p in paths:
        parts = pathlib.Path(p).resolve().parts
        for k in range(2, len(parts) + 1):
            d = pathlib.Path(*parts[:k])
            if d.is_dir() and not d.stat().st_mode & 0o001 and str(d) not in out:
                out.append(str(d))
    return sorted(out, key=lambda d: d.count("/"))


VIEW = r"""
set -e
scratch=$1; shift; k=0
while [ "$1" != "--" ]; do
    d=$1; shift; k=$((k + 1)); s=$scratch/stash$k; v=$scratch/view$k
    mkdir -p "$s" "$v"
    mount --bind "$d" "$s"
    mount -t tmpfs -o mode=755 labkit-view "$v"
    for e in "$s"/* "$s"/.[!.]* "$s"/..?*; do
        [ -e "$e" ] || [ -L "$e" ] || continue
        n=${e##*/}
        if [ -L "$e" ]; then cp -P "$e" "$v/$n"
        elif [ -d "$e" ]; then mkdir "$v/$n"; mount --rbind "$e" "$v/$n"
        else touch "$v/$n"; mount --bind "$e" "$v/$n"; fi
    done
    mount --rbind "$v" "$d"
done
shift
exec "$@"
"""


def in_view(cmd: list[str], scratch: str) -> list[str]:
    """`cmd` run where students can enter the directories this Python and labkit live in."""
    import labkit

    needed = {sys.executable, os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, str(ROOT)}
    needed |= {p for p in sys.path if p and os.path.isdir(p)} | {os.path.dirname(labkit.__file__)}
    closed = closed_dirs(needed)
    if not closed:
        return cmd
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", VIEW, "view", scratch, *closed, "--", *cmd]


def check_students_can_run(name: str, scratch: str) -> None:
    """Refuse at the door, naming the fix, if student `name` cannot import what their server runs."""
    probe = [sys.executable, "-c", "import labkit, jupyterhub, ipyparallel, ipykernel"]
    got = subprocess.run(
        in_view(["runuser", "-u", name, "--", *probe], scratch), capture_output=True, text=True, timeout=300, cwd="/"
    )
    if got.returncode != 0:
        pytest.fail(
            f"student {name} cannot run {sys.executable} with labkit: {got.stderr.strip()[-800:]}\n"
            "install labkit and jupyterhub where every user can read them (classroom/README.md)"
        )


# -- the hub --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """A JupyterHub started from `config` (a jupyterhub_config.py's text, with {port}-style holes
    filled here: public, hub, proxy_api, state, chp, token), in its own directory."""

    def __init__(self, config: str, state: pathlib.Path, chp: str, **fill):
        self.state, self.token = state, uuid.uuid4().hex
        state.mkdir(parents=True, exist_ok=True)
        self.ports = {k: free_port() for k in ("public", "hub", "proxy_api")}
        text = config.format(**self.ports, state=state, chp=chp, token=self.token, classroom=CLASSROOM, **fill)
        (state / "jupyterhub_config.py").write_text(text)
        self.log_path = state / "hub.log"
        self.url = f"http://127.0.0.1:{self.ports['public']}"
        cmd = in_view([sys.executable, "-m", "jupyterhub", "-f", str(state / "jupyterhub_config.py")], str(state))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=state, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_end_with_me
            )
        try:
            self._wait(lambda: self.api("GET", "/users") is not None, "the hub did not answer")
        except BaseException:
            self.close()
            raise

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def _wait(self, ready, what: str, bound: float = START_S) -> None:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the hub exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if ready():
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{what} within {bound:g} s:\n{self.log()}")

    def api(self, method: str, path: str, body=None, token: str | None = None):
        """The hub's REST API (/hub/api + path) as the test's admin service; the JSON, or None."""
        req = urllib.request.Request(
            f"{self.url}/hub/api{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"token {token or self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
        return json.loads(raw) if raw else {}

    def server(self, user: str) -> dict | None:
        return self.api("GET", f"/users/{user}")["servers"].get("")

    def start(self, *users: str) -> None:
        """Start the users' servers at once (as their logins would), and wait until each answers."""
        with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
            list(pool.map(lambda u: self.api("POST", f"/users/{u}/server"), users))
        for user in users:
            self._wait(lambda u=user: (self.server(u) or {}).get("ready"), f"{user}'s server was not ready")

    def stop(self, *users: str) -> None:
        """Stop the users' servers (the admin's stop button; the idle culler sends the same request)."""
        for user in users:
            self.api("DELETE", f"/users/{user}/server")
        for user in users:
            self._wait(lambda u=user: self.server(u) is None, f"{user}'s server did not stop")

    def kernel(self, user: str) -> Kernel:
        token = self.api("POST", f"/users/{user}/tokens", {"note": "labkit test", "expires_in": 3600})["token"]
        return Kernel(self, user, token)

    def close(self) -> None:
        """Stop every server, then the hub (and the proxy it started)."""
        try:
            self.stop(*[u["name"] for u in self.api("GET", "/users") if u.get("servers")])
        except Exception:  # a hub already gone: its spawned servers are the fixture's to end
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.state, ignore_errors=True)


# -- a student's kernel ---------------------------------------------------------------------------
class KernelError(Exception):
    """The code raised in the student's kernel; the message is its traceback."""


ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Kernel:
    """A kernel of `user`'s server, started through the proxy with a token of theirs."""

    def __init__(self, hub: Hub, user: str, token: str):
        self.hub, self.user = hub, user
        self.headers = {"Authorization": f"token {token}", "Content-Type": "application/json"}
        base = f"{hub.url}/user/{user}/api/kernels"
        req = urllib.request.Request(base, method="POST", data=b"{}", headers=self.headers)
        with urllib.request.urlopen(req, timeout=120) as r:
            self.id = json.loads(r.read())["id"]
        self.ws_url = f"ws://127.0.0.1:{hub.ports['public']}/user/{user}/api/kernels/{self.id}/channels"

    def run(self, code: str, timeout: float = 300.0) -> str:
        """Execute `code`; its printed output. KernelError with the traceback if it raised,
        TimeoutError (the kernel interrupted) past `timeout`."""
        return asyncio.run(self._run(code, timeout))

    def result(self, code: str, timeout: float = 300.0) -> dict:
        """Execute `code`, which prints one line 'RESULT <json>'; that JSON."""
        out = self.run(code, timeout)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if not lines:
            raise KernelError(f"{self.user}'s cell printed no RESULT line:\n{out[-3000:]}")
        return json.loads(lines[-1][len("RESULT ") :])

    async def _run(self, code: str, timeout: float) -> str:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        ws = await websocket_connect(HTTPRequest(self.ws_url, headers=self.headers))
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "username": self.user, "session": msg_id}
        header |= {"version": "5.3", "date": ""}
        content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}}
        content |= {"allow_stdin": False, "stop_on_error": True}
        msg = {"header": header, "parent_header": {}, "metadata": {}, "content": content, "channel": "shell"}
        await ws.write_message(json.dumps(msg))
        out, error, replied, idle = [], None, False, False
        deadline = time.monotonic() + timeout
        try:
            while not (replied and idle):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._late(timeout, out)
                raw = await asyncio.wait_for(ws.read_message(), left)
                if raw is None:
                    raise ConnectionError(f"{self.user}'s kernel closed its websocket:\n{''.join(out)[-3000:]}")
                m = json.loads(raw)
                if m.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = m["msg_type"]
                if kind == "stream":
                    out.append(m["content"]["text"])
                elif kind == "error":
                    error = ANSI.sub("", "\n".join(m["content"]["traceback"]))
                elif kind == "execute_reply":
                    replied = True
                elif kind == "status":
                    idle = m["content"]["execution_state"] == "idle"
        except asyncio.TimeoutError:
            raise self._late(timeout, out) from None
        finally:
            ws.close()
        if error:
            raise KernelError(f"{self.user}'s cell raised:\n{error[-4000:]}\noutput:\n{''.join(out)[-2000:]}")
        return "".join(out)

    def _late(self, timeout: float, out: list[str]) -> TimeoutError:
        """Interrupt the kernel (a hang becomes an error, and the kernel is free again)."""
        url = f"{self.hub.url}/user/{self.user}/api/kernels/{self.id}/interrupt"
        with _quiet():
            urllib.request.urlopen(urllib.request.Request(url, method="POST", data=b"", headers=self.headers), 30)
        return TimeoutError(f"{self.user}'s cell ran past {timeout:g} s; its output:\n{''.join(out)[-3000:]}")


# -- helpers --------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def _end_with_me() -> None:
    """In the hub's process before it runs: SIGTERM when the test process dies, however it dies
    (the hub then stops every student's server, as at a normal close)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run(cmd: list[str]) -> None:
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {got.stderr.strip()}")


def _named(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline()[:4])}"
    except psutil.Error:
        return str(p.pid)


class _quiet:
    """Ignore what a process or a server already gone raises."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (psutil.Error, OSError))
