"""No orphans: a kernel that owns a Lab is killed with SIGKILL (no cleanup runs), and within 10 s
nothing the Lab started is left (controller, engines, whatever the launcher started here, the
watchdog itself) and its Slurm job is out of the queue (labkit/cluster/watchdog.py)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import psutil
import pytest
from launch_tools import slurm, slurm_jobs  # noqa: F401  (slurm: a fixture)

from labkit.cluster.watchdog import tagged

KERNEL = """
import json, sys, time
from labkit import Lab
from labkit.cluster.launchers import batch_file
lab = Lab(progress=False, device="cpu", timeout=120, **json.loads(sys.argv[1]))
print(json.dumps({"token": lab.engines.watchdog.token, "watchdog": lab.engines.watchdog.proc.pid,
                  "jobs": [cmd[-1] for cmd in lab.engines.started.cancels],
                  "script": batch_file(lab.engines.cluster)}), flush=True)
time.sleep(600)
"""
"""A notebook kernel's part: a Lab, then nothing (the test kills it)."""


def _kill_the_kernel(options: dict) -> dict:
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, json.dumps(options)], stdout=subprocess.PIPE, text=True)
    try:
        sel = selectors.DefaultSelector()
        sel.register(kernel.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=180), "the kernel's Lab did not start within 180 s"
        info = json.loads(kernel.stdout.readline())
        before = tagged(info["token"])
        roles = sorted(" ".join(p.cmdline()[1:3]) for p in before)
        assert len(before) >= 3, roles  # a controller, its heart monitor, the engines at least
        os.kill(kernel.pid, signal.SIGKILL)
        died = time.monotonic()
        kernel.wait(10)
        while time.monotonic() - died < 15:
            left = tagged(info["token"])
            jobs = set(info["jobs"]) & set(slurm_jobs()) if info["jobs"] else set()
            if not left and not jobs and not psutil.pid_exists(info["watchdog"]):
                assert not os.path.exists(info["script"])  # a batch launcher's script: removed too
                return {"processes": len(before), "roles": roles, "seconds": time.monotonic() - died}
            time.sleep(0.05)
        pytest.fail(f"15 s after the kernel's death: left {left}, jobs {jobs}, watchdog {info['watchdog']}")
    finally:
        if kernel.poll() is None:
            kernel.kill()


def test_a_killed_kernel_leaves_no_process_of_its_lab():
    got = _kill_the_kernel({"engines": 2})
    print(f"\nlocal Lab(engines=2): {got['processes']} processes, all gone {got['seconds']:.2f} s after SIGKILL")
    print(got["roles"])
    assert got["seconds"] <= 10


@pytest.mark.slow
def test_a_killed_kernel_leaves_no_slurm_job(slurm):  # noqa: F811
    got = _kill_the_kernel({"engines": 2, "launcher": "slurm", "controller_ip": "127.0.0.1"})
    print(
        f"\nslurm Lab(engines=2): {got['processes']} processes, job and all gone {got['seconds']:.2f} s after SIGKILL"
    )
    assert got["seconds"] <= 10
