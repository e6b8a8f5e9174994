"""Fixtures for the tests that need outside tools: a one-node Slurm (scripts/slurm-local.sh), Open MPI's
mpiexec, two hosts in network namespaces (scripts/netns-hosts.sh).

A test skips, saying which tool is missing, only where the tool is not installed; CI installs them
all (.ci/run) and sets LABKIT_REQUIRE_CLUSTER_TOOLS=1, which turns such a skip into a failure.
Whatever a fixture starts (Slurm's daemons, the namespaces) it stops in its finalizer; a Slurm that
was already up (CI starts it) is left up.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm-local.sh"
NETNS = ROOT / "scripts" / "netns-hosts.sh"


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        why = f"needs {', '.join(missing)} (apt-get install slurm-wlm munge openmpi-bin iproute2; .ci/run does)"
        if os.environ.get("LABKIT_REQUIRE_CLUSTER_TOOLS"):
            pytest.fail(why + ": CI must run this test")
        pytest.skip(why)
    if os.geteuid() != 0:
        why = "needs root (Slurm's daemons, network namespaces)"
        if os.environ.get("LABKIT_REQUIRE_CLUSTER_TOOLS"):
            pytest.fail(why + ": CI must run this test")
        pytest.skip(why)


def _slurm(*args: str, check=True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(SLURM), *args], capture_output=True, text=True, timeout=120)
    if check and out.returncode != 0:
        logs = subprocess.run([str(SLURM), "logs"], capture_output=True, text=True).stdout
        raise RuntimeError(f"slurm-local.sh {' '.join(args)} failed:\n{out.stdout}{out.stderr}\n{logs[-4000:]}")
    return out


@pytest.fixture(scope="session")
def slurm():
    """A one-node Slurm answering on SLURM_CONF (started here unless it already runs)."""
    need("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel")
    conf = _slurm("env").stdout.strip().split("=", 1)[1]
    was_up = _slurm("status", check=False).returncode == 0
    if not was_up:
        _slurm("start")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # sbatch, squeue and scancel (here and in the Lab) read it
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if not was_up:
            _slurm("stop", check=False)


def slurm_jobs() -> list[str]:
    """The jobs in the queue (ids), of every user."""
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def two_hosts():
    """labkit-a (this network namespace) and labkit-b (its own) joined by a veth pair; yields the
    script (its ssh / scp / stats subcommands), removed at the end."""
    need("ip", "unshare")
    up = subprocess.run([str(NETNS), "up"], capture_output=True, text=True, timeout=60)
    if up.returncode != 0:
        subprocess.run([str(NETNS), "down"], capture_output=True)
        raise RuntimeError(f"netns-hosts.sh up failed: {up.stdout}{up.stderr}")
    try:
        yield NETNS
    finally:
        subprocess.run([str(NETNS), "down"], capture_output=True, timeout=60)


def link_stats() -> dict[str, dict[str, int]]:
    """The veth pair's counters, per end: {'lk21a0': {'tx_bytes': ..., ...}, 'lk21b0': {...}}."""
    out = subprocess.run([str(NETNS), "stats"], capture_output=True, text=True, timeout=30, check=True).stdout
    stats = {}
    for line in out.strip().splitlines():
        dev, *pairs = line.split()
        stats[dev] = {k: int(v) for k, v in (p.split("=") for p in pairs)}
    return stats
