"""No orphans: a small process per Lab that ends everything the Lab started once its kernel is gone.

A kernel can die without running any cleanup (SIGKILL, the OOM killer, a forced restart), and the
Lab's controller, engines and nannies then live on, each holding its memory (and on a GPU server
its GPU memory). So every Lab that starts a cluster also starts this watchdog, in its own session
(setsid: a signal to the kernel's process group does not reach it). It learns of the kernel's death
at once: it reads a pipe whose only writer is the kernel, and the kernel's end closes when the
kernel dies, however it dies (polling the kernel's pid as well, in case a forked child of the
kernel holds the pipe open). Then it
  - runs the cancel command of every scheduler job the Lab submitted (scancel JOBID), and
  - ends every process whose environment carries the Lab's tag (labkit/cluster/launchers.py: TAG), which
    every process a launcher starts inherits: SIGTERM, then SIGKILL to what is left after KILL_AFTER_S,
  - removes the files it was told of (the batch script a scheduler launcher wrote).
A Lab that closes normally tells the watchdog, which then only sweeps up what the cluster's own
stop left behind and exits. Run as a script (`python -I labkit/cluster/watchdog.py PID TOKEN`), it imports
nothing but the standard library and psutil, so it holds ~15 MiB.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import psutil

TAG = "LABKIT_LAB"  # = labkit.cluster.launchers.TAG (the script imports nothing from labkit)
POLL_S = 0.5
"""How often the watchdog also checks the kernel's pid."""
KILL_AFTER_S = 1.0
"""From SIGTERM to SIGKILL for what is still running."""
GONE_WITHIN_S = 8.0
"""How long the watchdog waits, in all, for the last tagged process to be gone."""


# -- the kernel's side ------------------------------------------------------------------------
class Watchdog:
    """The kernel's handle on its Lab's watchdog process."""

    def __init__(self, token: str):
        self.token = token
        read, write = os.pipe()  # the write end is the kernel's alone (not inherited by exec'd children)
        # -I: isolated (no user site, no PYTHONPATH); start_new_session: setsid, so a signal to the
        # kernel's process group does not reach it
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), token],
            stdin=read,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
        os.close(read)
        # line-buffered: each instruction reaches the watchdog when it is said, not when the kernel dies
        self._pipe = os.fdopen(write, "w", buffering=1)

    def cancel_on_death(self, command: list[str]) -> None:
        """Run `command` (e.g. ['scancel', '123']) if the kernel dies."""
        self._say(f"cancel {json.dumps(command)}")

    def remove_on_death(self, path: str) -> None:
        """Remove the file `path` (a batch script the launcher wrote) if the kernel dies."""
        self._say(f"remove {json.dumps(path)}")

    def close(self, wait: float = GONE_WITHIN_S + 2) -> None:
        """The Lab is closing normally: sweep what is left of it, then exit (waited for)."""
        self._say("close")
        try:
            self._pipe.close()
            self.proc.wait(timeout=wait)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _say(self, line: str) -> None:
        try:
            self._pipe.write(line + "\n")
        except (OSError, ValueError):  # the watchdog is gone (or closed): nothing to tell
            pass


# -- the watchdog's side ------------------------------------------------------------------------
def tagged(token: str) -> list[psutil.Process]:
    """Every process whose environment says TAG=token (the watchdog itself carries no tag)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG) == token:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def end_all(token: str, cancels: list[list[str]]) -> int:
    """Cancel the jobs and end every tagged process; returns how many processes it signalled."""
    for cmd in cancels:
        try:
            # bounded: a scheduler that does not answer must not keep the processes alive
            subprocess.run(cmd, timeout=10, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            pass
    start, signalled = time.monotonic(), set()
    while time.monotonic() - start < GONE_WITHIN_S:
        left = tagged(token)  # zombies excepted: their environment cannot be read
        if not left:
            break
        # SIGTERM first, so that each process may clean up; SIGKILL to what is left past KILL_AFTER_S
        late = time.monotonic() - start > KILL_AFTER_S
        for p in left:
            try:
                p.kill() if late else p.terminate()
            except psutil.NoSuchProcess:
                pass
            signalled.add(p.pid)
        psutil.wait_procs(left, timeout=0.2)
    return len(signalled)


def watch(owner_pid: int, token: str, fd: int = 0) -> bool:
    """Until the owner dies (True) or says close (False), reading its lines from `fd`; collects
    the cancel commands."""
    cancels: list[list[str]] = []
    files: list[str] = []
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None
    pending = b""
    # a zombie owner is dead: its pid only lingers until its parent reaps it
    while owner is not None and owner.is_running() and owner.status() != psutil.STATUS_ZOMBIE:
        # woken every POLL_S to look at the pid too: a forked child of the kernel may hold the pipe open
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # EOF: the kernel's end of the pipe is closed, so the kernel is gone
            break
        # a line the read cut in two waits in `pending` for its end
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            word, _, rest = line.decode().strip().partition(" ")
            if word == "cancel":
                cancels.append(json.loads(rest))
            elif word == "remove":
                files.append(json.loads(rest))
            elif word == "close":
                # a normal close: no job to cancel, only what the cluster's own stop left to sweep
                end_all(token, [])
                return False
    end_all(token, cancels)
    for path in files:
        try:
            os.remove(path)
        except OSError:
            pass
    return True


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
