"""Lab.connect: attach to a cluster started elsewhere with ipcluster (the multi-node path),
through its authenticated connection file."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from conftest import TINY

from labkit import Lab, ParallelConfig
from labkit.oracle.checks import assert_matches


def _ipcluster(*args, **kw):
    return subprocess.run(
        [sys.executable, "-m", "ipyparallel.cluster", *args], capture_output=True, text=True, timeout=120, **kw
    )


@pytest.fixture
def ipcluster(tmp_path):
    profile = tmp_path / "profile"
    out = _ipcluster(
        "start",
        "--n=2",
        f"--profile-dir={profile}",
        "--cluster-id=labkit-test",
        "--daemonize",
        "--init",
        "--log-level=ERROR",
    )
    assert out.returncode == 0, out.stderr
    try:
        yield profile
    finally:
        _ipcluster("stop", f"--profile-dir={profile}", "--cluster-id=labkit-test")


def test_connect_to_an_ipcluster(ipcluster, ref_cache):
    url_file = ipcluster / "security" / "ipcontroller-labkit-test-client.json"
    deadline = time.monotonic() + 60
    while not url_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "key" in json.loads(url_file.read_text())  # an authenticated connection
    lab = Lab.connect(url_file=str(url_file), engines=2, progress=False, timeout=120)
    try:
        assert lab.world == 2 and lab.backend == "gloo"
        res = lab.run(ParallelConfig(dp=2), model=TINY, steps=3, return_params=True)
        assert_matches(res, ref_cache())
    finally:
        lab.close()
