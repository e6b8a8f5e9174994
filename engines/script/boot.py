"""The start of a script's process: labkit's meters put in, then the script run as Python runs it.

    python -m labkit.engines.script.boot FD PID path train.py --flag ...     # python train.py --flag ...
    python -m labkit.engines.script.boot FD PID module pkg.train --flag ...  # python -m pkg.train --flag ...

The engine's job (engines/script/agent.py) starts this with torchrun's environment (RANK, MASTER_PORT,
...; labkit/cluster/script/contract.py) the write end of a pipe (FD) and its own pid (PID). Before the script's first
line: the comm meter at PyTorch's dispatcher (engines/meters/comm.py: every collective, whoever issues
it), a Tracker (engines/tracking.py: `labkit.track` and `labkit.region` work in the script; memory,
phases and steps), the finds (engines/script/finds.py: DDP, fully_shard, parallelize_module,
PipelineStage, optimizers and named meshes found without a line of labkit), and the shipper
(engines/script/ship.py). The script then runs as `python train.py` would run it: `sys.argv`, `sys.path[0]`
the script's folder (`-m`: the working directory), `__name__ == "__main__"`, its exit code its own
(sys.exit, an exception's 1, os._exit), the traceback Python would print. It dies with its engine
(PR_SET_PDEATHSIG). The meters cost what they cost in a Lab run; nothing else differs.
"""

from __future__ import annotations

import builtins
import ctypes
import io
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import types
from importlib.machinery import SourceFileLoader

import torch

from labkit.engines.meters.comm import CommMeter
from labkit.engines.script import finds
from labkit.engines.script.ship import Channel, Shipper
from labkit.engines.tracking import Tracker

PR_SET_PDEATHSIG = 1  # linux/prctl.h
OURS = (__file__, runpy.__file__)
"""Frames of this start, left out of the script's traceback (Python's own shows none of them)."""


def die_with_parent(parent: int) -> None:
    """SIGKILL when the engine dies, however it dies (Linux; elsewhere the engine's stop is the bound)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the call above
            os._exit(1)


def run(mode: str, target: str, args: list[str]) -> None:
    """The script as `python target args` (mode 'path') or `python -m target args` ('module') runs it."""
    if mode == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # as `python target` runs it: argv[0] as typed, __file__ absolute (Python >= 3.9), no __spec__,
        # the module __main__ for good (pickle and multiprocessing find the script's functions there)
        path = os.path.abspath(target)
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(path)
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec")
        main = types.ModuleType("__main__")
        main.__dict__.update(
            __file__=path,
            __cached__=None,
            __spec__=None,
            __loader__=SourceFileLoader("__main__", path),
            __builtins__=builtins,
        )
        sys.modules["__main__"] = main
        exec(code, main.__dict__)


def script_traceback(exc: BaseException) -> str:
    """The traceback as Python prints it for `python train.py`: without this start's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in OURS:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def main(argv: list[str]) -> None:
    fd, parent, mode, target, args = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4:]
    die_with_parent(parent)
    channel = Channel(fd)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    meter = CommMeter({}).__enter__()  # the script's collective log, from its first line
    tracker = Tracker(meter, device, world, rank)
    Tracker.current = tracker  # labkit.track / labkit.region inside the script
    finds.install(tracker, rank=rank, host=socket.gethostname())
    shipper = Shipper(channel, meter, threading.current_thread())
    shipper.start()
    code: int | str | None = 0
    try:
        with tracker.memory.saved_tensors():
            run(mode, target, args)
    except SystemExit as e:  # the script's sys.exit: its code, as Python would exit with it
        code = e.code
    except BaseException as e:  # as Python: the traceback on stderr, exit code 1
        text = script_traceback(e)
        sys.stderr.write(text)
        channel.send("failure", {"traceback": text, "at": time.time()})
        code = 1
    finally:
        try:
            tracker.finish()
            shipper.stop()
            channel.send("report", report(tracker))
        except Exception as e:  # the script's own exit code stands; the report says what it lacks
            channel.send("failure", {"traceback": f"labkit's report failed: {e!r}", "at": time.time(), "ours": True})
    sys.exit(code)


def report(tracker: Tracker) -> dict:
    """What the rank measured (plain data): the Tracker's views, as Lab.measure's (engines/measure.py)."""
    return {
        "coords": tracker.coords,
        "steps": tracker.steps,
        "memory": tracker.memory_report(),
        "comm": tracker.comm_events(),
        "timeline": tracker.timeline.events,
        "notes": list(finds.NOTES),
        # at its end, as the script left it: OMP_NUM_THREADS=1 from torchrun's contract unless it changed it
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    main(sys.argv[1:])
