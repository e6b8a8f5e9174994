"""A local Lab's engines, forked from one process that has imported what every engine imports.

    python -m labkit.cluster.forked N LOGS -m ipyparallel.engine [engine args...]

Each engine started alone imports torch, ipyparallel's engine and labkit's engine code: about 2 s of
one core, the most of a Lab's start (4 engines on 2 cores: 8 core-s; benchmarks/lab_start.py). This
process imports them once and forks N engines, each an ipyparallel engine as `python -m
ipyparallel.engine` would have run it, with those modules already loaded; their pages are shared until
written, so N engines hold less memory too. Forking after `import torch` is what PyTorch's own
DataLoader workers do on Linux; nothing here runs an op, so no thread pool or GPU context exists
to be lost in the fork (each engine makes its own after it).

Each engine writes to its own file, LOGS-<i>.log (ipyparallel's name for a local engine's), and names
itself ENGINE_NAME (what `ps` shows, and how labkit/cluster/census.py tells the engines from this
process, whose command line they share). This process forwards SIGTERM, SIGINT and SIGHUP to the
engines, waits for every one, and exits with the first failing engine's code; an engine dies with it
(PR_SET_PDEATHSIG) if it is killed. ipyparallel sees one process for the set, as it does with mpiexec
(labkit/cluster/launchers.py: ForkedEngines).

Imports that load torch or ipyparallel are inside functions: the notebook imports this module
(labkit/cluster/census.py reads its names) without them (tests/test_layers.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback

from labkit.engines import host

MODULE = "labkit.cluster.forked"
"""This program's module (`python -m MODULE`): on the command line of the set's process and its engines."""
ENGINE_NAME = "labkit-engine"
"""An engine's process name (its /proc comm; at most 15 bytes)."""
ENGINE = ["-m", "ipyparallel.engine"]
"""The one engine command this process forks (ipyparallel's own, without its interpreter)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1  # linux/prctl.h


def preload() -> None:
    """What every engine would import at its start, or at its first call: once, here."""
    import ipyparallel.engine.app  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from labkit.engines import train  # noqa: F401  (the model, the strategies, the meters)


def become_engine(i: int, logs: str, args: list[str], parent: int | None) -> None:
    """Engine i of the set, its output to its own file; never returns. parent: the set's process,
    in a forked child; None when this process is the set's one engine."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a process of its own
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # blocked by the parent around the fork
    libc = ctypes.CDLL(None, use_errno=True)
    if parent is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above: nothing would end this engine
            os._exit(1)
    libc.prctl(PR_SET_NAME, ENGINE_NAME.encode())
    fd = os.open(f"{logs}-{i}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [sys.argv[0], *args]
    from ipyparallel.engine.app import main

    code = 0
    try:
        main()
    except SystemExit as e:  # as the interpreter says it: sys.exit("why") prints why and exits 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.__stderr__)  # its own log file (ipykernel may have replaced sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc(file=sys.__stderr__)
        code = 1
    # Python's teardown of a process with torch loaded takes ~0.6 s of a core and finalizes nothing
    # an engine needs (as at its SIGTERM: engines/host.py end_at_once_on_sigterm)
    host.exit_now(code)


def supervise(children: dict[int, int]) -> int:
    """Wait for every engine (pid -> index); the first failing one's exit code (128 + a signal's
    number, as a shell says it), else 0."""
    codes = []
    while children:
        try:
            pid, status = os.wait()  # retried after a forwarded signal (PEP 475)
        except ChildProcessError:
            break
        if children.pop(pid, None) is not None:
            code = os.waitstatus_to_exitcode(status)
            codes.append(128 - code if code < 0 else code)
    return next((c for c in codes if c), 0)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or not argv[0].isdigit() or argv[2:4] != ENGINE:
        sys.exit(f"usage: python -m {MODULE} N LOGS {' '.join(ENGINE)} [engine args...]; got {argv}")
    n, logs, args = int(argv[0]), argv[1], argv[4:]
    preload()
    if n == 1:  # one engine (a replacement, Lab(engines=1)): this process is it; a fork would add a parent
        become_engine(0, logs, args, parent=None)
    children: dict[int, int] = {}

    def forward(signum, frame):
        for pid in list(children):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    parent = os.getpid()
    for i in range(n):
        sys.stdout.flush()
        sys.stderr.flush()
        # a signal between the fork and the lines after it would run `forward` in the child, on its
        # siblings, or miss the new child in the parent: held until both know where they stand
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        pid = os.fork()
        if pid == 0:
            become_engine(i, logs, args, parent)
        children[pid] = i
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    return supervise(children)


if __name__ == "__main__":
    host.exit_now(main(sys.argv[1:]))  # the set's process, its engines gone: no teardown either
