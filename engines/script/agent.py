"""A script's rank on its engine, as torchrun's agent runs a worker: a child process of the engine,
started with torchrun's environment, watched until it exits, stopped when the Lab says so.

The Lab (labkit/cluster/script/) calls `open_store` on rank 0 (the script world's rendezvous store,
hosted by the agent as torchrun's is: TORCHELASTIC_USE_AGENT_STORE=True), then `run_rank` as one job
on every rank (engines/runtime.py: polled, cancelled, diagnosed like any), then `end_call` on every
rank: nothing the script started outlives the call, and the store is closed.

`run_rank` starts `python -m labkit.engines.script.boot` (engines/script/boot.py) in a session of
its own (as torchrun's workers: start_new_session), reads its three pipes in the job thread:
  the messages pipe    the script's collectives, steps and report, into the job's collective log
                       (engines/script/log.py) and progress records;
  stdout, stderr       each line a progress record {rank, stream, text} (the notebook shows them
                       as they come) and kept whole for the result (the last KEEP characters);
and on a cancel (the Lab's timeout, Ctrl-C, another rank's failure) sends the session SIGTERM, then
SIGKILL after STOP_S, as torchrun's agent stops its workers. Its exit code is the script's: 0 returns
the rank's report, anything else raises ScriptExit with the script's traceback (the Lab reads the
report of every rank then, `report`).

The engine's own process group is never used: the script has a world of its own (MASTER_ADDR /
MASTER_PORT: the store here), so a script that crashes, leaks threads or never destroys its groups
leaves the engine as it was. Torch-free at import: the notebook names these functions.
"""

from __future__ import annotations

import codecs
import datetime
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from labkit.engines import runtime
from labkit.engines.script.log import ScriptLog

STOP_S = 5.0
"""SIGTERM to SIGKILL. torchrun waits 30 s (its --stop-timeout) for workers that checkpoint on SIGTERM;
a Lab call stops within its own bounds (labkit/cluster/faults.py CANCEL_GRACE_S is 10 s)."""
DRAIN_S = 1.0
"""After the script's process exits, how long its pipes may stay open (a worker it forked holds them)
before its session is killed."""
KEEP = 1 << 20
"""Characters of stdout and of stderr a rank keeps for the result (the last ones; every line is also
shown as it comes)."""
BOOT = "labkit.engines.script.boot"


class ScriptExit(Exception):
    """The script's process exited with a code other than 0 on this rank."""


class _Call:
    store = None  # rank 0: the script world's TCPStore, from open_store to end_call
    proc: subprocess.Popen | None = None  # the script's process while it runs
    last: dict | None = None  # the last run_rank's report, for the Lab's `report`


_call = _Call()


# -- the store and the end of a call (the Lab's bounded calls, not jobs) ---------------------
def open_store(addr: str, world: int, timeout_s: float) -> int:
    """Rank 0: listen on `addr` on a port the OS picks and serve the script world's store there (the
    socket handed to the store, as engines/process_group.py does: no port guessed, no other address).
    Returns MASTER_PORT."""
    import torch.distributed as dist  # engines only; the notebook names this function

    end_call()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((addr, 0))
    s.listen(256)
    port = s.getsockname()[1]
    _call.store = dist.TCPStore(
        addr,
        port,
        world,
        True,
        datetime.timedelta(seconds=timeout_s),
        master_listen_fd=s.detach(),
        wait_for_workers=False,
        use_libuv=True,
    )
    return port


def end_call() -> dict:
    """The end of a Lab call on this rank: a script's process still there (and its session) killed,
    the store closed. Returns what was left."""
    left = {"process": False, "store": _call.store is not None}
    proc = _call.proc
    if proc is not None and proc.returncode is None:
        left["process"] = True
        _kill(proc, signal.SIGKILL)
    _call.store = None  # the store's server stops with its last reference
    return left


def report() -> dict | None:
    """The last script's report on this rank (after a failure too: what the Lab's error carries)."""
    return _call.last


# -- the job -------------------------------------------------------------------------------
def run_rank(spec: dict) -> dict:
    """One rank of the script (the Lab's job): spec holds `target`, `module`, `args`, `cwd`, `source`
    (a cell's text, or None), `env` (the user's), `envs` (each rank's torchrun variables,
    labkit/cluster/script/contract.py)."""
    rt = runtime.current()
    _call.last = None
    cwd = spec["cwd"]
    if not os.path.isdir(cwd):
        raise ScriptExit(f"the working directory {cwd} does not exist on {rt.host} (rank {rt.rank})")
    mode = "module" if spec["module"] else "path"
    if spec.get("source") is None and mode == "path" and not os.path.isfile(os.path.join(cwd, spec["target"])):
        raise ScriptExit(
            f"{spec['target']} does not exist on {rt.host} (rank {rt.rank}, in {cwd}): like torchrun, every host "
            "runs its own copy of the script; put it there (or on a filesystem every host shares)"
        )
    tmp = tempfile.mkdtemp(prefix="labkit-script-")  # a cell's copy and the error file
    try:
        rep, stopped = _run(rt, spec, mode=mode, tmp=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # whatever the end: nothing of the call left on the host
    _call.last = rep
    if stopped:
        raise runtime.Cancelled()
    if rep["exit_code"] != 0:
        why = (rep["failure"] or {}).get("traceback") or "".join(rep["stderr"].splitlines(True)[-20:])
        raise ScriptExit(f"{spec['target']} exited with code {rep['exit_code']} on rank {rt.rank}\n{why}")
    return rep


def _run(rt, spec: dict, *, mode: str, tmp: str) -> tuple[dict, bool]:
    """The script's process started, watched until it exits and its session killed: (its report,
    whether the Lab stopped it)."""
    cwd, target = spec["cwd"], spec["target"]
    if spec.get("source") is not None:  # a notebook cell: written where this rank can run it
        target = os.path.join(tmp, os.path.basename(target))
        with open(target, "w") as f:
            f.write(spec["source"])
    # the engine's environment (the notebook's, where it started here), the user's env=, then torchrun's
    env = {
        **os.environ,
        **spec["env"],
        **spec["envs"][rt.rank],
        "TORCHELASTIC_ERROR_FILE": os.path.join(tmp, "error.json"),
    }
    if spec.get("source") is not None:  # a cell's imports find the notebook's folder, as its cells do
        env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, env.get("PYTHONPATH")) if p)
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", BOOT, str(w), str(os.getpid()), mode, target, *spec["args"]],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(w,),
            start_new_session=True,  # its own session: a stop reaches whatever it starts
        )
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    _call.proc = proc
    log = ScriptLog()
    runtime.use_log(log)
    watch = _Watch(proc, r, log=log, rank=rt.rank)
    try:
        watch.until_exit()
    finally:
        log.gone = True
        _kill(proc, signal.SIGKILL)  # whatever the script left running in its session
        _call.proc = None
    return _report(rt, spec, watch, log=log, error_file=os.path.join(tmp, "error.json")), watch.stopped


class _Watch:
    """The job thread's loop over the script's three pipes, until it has exited and they are closed."""

    def __init__(self, proc, messages: int, *, log: ScriptLog, rank: int):
        self.proc, self.log, self.rank = proc, log, rank
        self.sel = selectors.DefaultSelector()
        self.pending = b""
        self.text = {"stdout": "", "stderr": ""}
        self.partial = {"stdout": "", "stderr": ""}
        self.decoders = {k: codecs.getincrementaldecoder("utf-8")("replace") for k in self.text}
        for fd, what in ((messages, "messages"), (proc.stdout.fileno(), "stdout"), (proc.stderr.fileno(), "stderr")):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, what)
        self.report: dict | None = None
        self.failure: dict | None = None
        self.stopped = False
        self.exit_code: int | None = None
        self.rss = 0
        self.started, self.ended = time.time(), None

    def until_exit(self) -> None:
        job = runtime.current_job()
        term_at = exited_at = None
        while True:
            for key, _ in self.sel.select(0.05):
                self._read(key.fd, key.data)
            if job.cancel.is_set() and term_at is None and self.exit_code is None:
                self.stopped, term_at = True, time.monotonic()
                _kill(self.proc, signal.SIGTERM)
            if term_at is not None and self.exit_code is None and time.monotonic() - term_at > STOP_S:
                _kill(self.proc, signal.SIGKILL)
            if self.exit_code is None:
                self._reap()
                exited_at = time.monotonic() if self.exit_code is not None else None
            if self.exit_code is not None:
                if not self.sel.get_map():
                    return
                if time.monotonic() - exited_at > DRAIN_S:  # a process it started holds the pipes
                    _kill(self.proc, signal.SIGKILL)
                    for key in list(self.sel.get_map().values()):
                        self._read(key.fd, key.data)
                        self._close(key.fd)
                    return

    def _reap(self) -> None:
        pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        if pid:
            self.exit_code = self.proc.returncode = os.waitstatus_to_exitcode(status)  # -N: signal N
            self.rss = usage.ru_maxrss * 1024  # KiB on Linux
            self.ended = time.time()

    def _read(self, fd: int, what: str) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self._close(fd)
            if what != "messages":
                self._text(what, self.decoders[what].decode(b"", final=True), final=True)
            return
        if what == "messages":
            self.pending += data
            *lines, self.pending = self.pending.split(b"\n")
            for line in lines:
                self._message(json.loads(line))
        else:
            self._text(what, self.decoders[what].decode(data))

    def _close(self, fd: int) -> None:
        what = self.sel.unregister(fd).data
        if what == "messages":
            os.close(fd)
        else:
            getattr(self.proc, what).close()

    def _message(self, msg: list) -> None:
        kind, body = msg[0], msg[1:]
        if kind == "progress":
            runtime.progress(**body[0])
        elif kind == "report":
            self.report = body[0]
        elif kind == "failure":
            if not body[0].get("ours") or self.failure is None:
                self.failure = body[0]
        else:
            self.log.take(kind, body)

    def _text(self, stream: str, text: str, final: bool = False) -> None:
        """Each line (a '\\r' ends one too: a progress bar redrawn) a record; the whole kept."""
        kept = self.text[stream] + text
        self.text[stream] = kept[-KEEP:]
        buf = self.partial[stream] + text
        cut = max(buf.rfind("\n"), buf.rfind("\r"))
        done, self.partial[stream] = (buf, "") if final else (buf[: cut + 1], buf[cut + 1 :])
        start = 0
        for i, ch in enumerate(done):
            if ch in "\n\r":
                if i > start:
                    runtime.progress(rank=self.rank, stream=stream, text=done[start:i], redrawn=ch == "\r")
                start = i + 1
        if final and start < len(done):
            runtime.progress(rank=self.rank, stream=stream, text=done[start:], redrawn=False)


def _report(rt, spec: dict, watch: _Watch, *, log: ScriptLog, error_file: str) -> dict:
    """The rank's report: the script's own (boot.py) where it lived to send it, else what the log saw."""
    mine = watch.report or {}
    failure = watch.failure
    if failure is None and os.path.isfile(error_file):  # written by torch.distributed.elastic's @record
        failure = _error_file(error_file)
    if failure is None and watch.exit_code not in (0, None):
        failure = {"at": watch.ended}
    notes = list(mine.get("notes", []))
    if not mine:
        notes.append(
            "the script's process ended before its report (os._exit, or killed): its collectives are those shipped"
        )
    return {
        "rank": rt.rank,
        "host": rt.host,
        "device": rt.device,
        "clock_offset": rt.clock_offset,
        "pid": watch.proc.pid,
        "exit_code": watch.exit_code,
        "stopped": watch.stopped,
        "started": watch.started,
        "ended": watch.ended,
        "rss": watch.rss,
        "stdout": watch.text["stdout"],
        "stderr": watch.text["stderr"],
        "failure": failure,
        "notes": notes,
        "coords": mine.get("coords", {}),
        "steps": mine.get("steps", 0),
        "memory": mine.get("memory") or {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "peak": 0},
        "comm": mine["comm"] if "comm" in mine else log.comm_events(len(spec["envs"])),
        "timeline": mine.get("timeline", []),
        "threads": mine.get("threads", 0),
        "value": None,
    }


def _error_file(path: str) -> dict | None:
    """torchrun's error file ({"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}})."""
    try:
        with open(path) as f:
            msg = json.load(f)["message"]
        info = msg.get("extraInfo", {}) if isinstance(msg, dict) else {}
        text = info.get("py_callstack") or (msg.get("message") if isinstance(msg, dict) else str(msg))
        return {"traceback": text, "at": float(info.get("timestamp", time.time())), "error_file": path}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _kill(proc, sig: int) -> None:
    """`sig` to the script's session (its process and whatever it started), if any is left."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def gpu_id() -> str | None:
    """This engine's GPU as CUDA_VISIBLE_DEVICES names it ('GPU-<uuid>'), None on the CPU: each rank's
    script then sees its node's GPUs in local-rank order (labkit/cluster/script/contract.py)."""
    import torch  # engines only; the notebook names this function

    device = runtime.current().device
    if not device.startswith("cuda"):
        return None
    uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
