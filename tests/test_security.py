"""A local Lab listens on 127.0.0.1 only, its rendezvous store stops listening once the ranks have
joined, two Labs on one machine never collide on ports, and the notebook talks to the cluster
through ipyparallel's authenticated (HMAC-signed) connection.
(Lab.connect's use of a connection file is tested in test_connect.py.)"""

from __future__ import annotations

import json

import psutil
import pytest
from conftest import TINY

from labkit import Lab, ParallelConfig
from labkit.oracle.checks import assert_matches

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _processes(lab) -> list[psutil.Process]:
    """The controller (with its scheduler processes) and every engine of a local Lab."""
    ctrl = psutil.Process(lab.engines.cluster.controller.pid)
    return [ctrl, *ctrl.children(recursive=True), *(psutil.Process(pid) for pid in lab.engines.pids)]


def _cluster_processes() -> list[psutil.Process]:
    """Every ipyparallel process this test run started: controllers, engines and the engines'
    nannies, of every Lab alive now."""
    return [p for p in psutil.Process().children(recursive=True) if "ipyparallel" in " ".join(p.cmdline())]


def _listening(lab=None) -> list[tuple[str, int, str]]:
    out = []
    for p in _processes(lab) if lab is not None else _cluster_processes():
        for c in p.net_connections("inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append((c.laddr.ip, c.laddr.port, " ".join(p.cmdline()[1:3])))
    return out


def test_a_local_lab_listens_on_loopback_only(lab):
    lab.run(ParallelConfig(dp=2), model=TINY, steps=1)  # gloo's groups and the store are up
    seen = _listening()
    print(
        f"\nlistening sockets of {len(_cluster_processes())} cluster processes: "
        f"{sorted({(ip, what) for ip, _, what in seen})}, {len(seen)} in all"
    )
    assert seen, "found no listening socket at all: the check would prove nothing"
    assert {ip for ip, _, _ in seen} <= LOOPBACK, [s for s in seen if s[0] not in LOOPBACK]
    rank0 = psutil.Process(lab.engines.pids[0]).net_connections("inet")
    # the rendezvous (TCPStore, no authentication) took its connections on loopback, then stopped
    # listening: the ranks' own connections to it are all that is left (engines/rendezvous.py)
    assert not [c for c in rank0 if c.status == psutil.CONN_LISTEN and c.laddr.port == lab.engines.port]
    served = [c for c in rank0 if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == lab.engines.port]
    assert served and {c.laddr.ip for c in served} == {"127.0.0.1"}


def test_the_client_connection_is_authenticated(lab):
    key = lab.engines.client.session.key
    assert isinstance(key, bytes) and len(key) >= 16  # every message is HMAC-signed with it
    assert lab.engines.client.session.signature_scheme.startswith("hmac-")
    for who in ("client", "engine"):
        path = f"{lab.engines.cluster.profile_dir}/security/ipcontroller-{lab.engines.cluster.cluster_id}-{who}.json"
        info = json.loads(open(path).read())
        assert info["key"].encode() == key and info["signature_scheme"] == lab.engines.client.session.signature_scheme


@pytest.fixture
def second_lab():
    with Lab(engines=2, timeout=120, progress=False, device="cpu") as other:
        yield other


def test_two_labs_side_by_side_do_not_collide(lab, second_lab, ref_cache):
    ports = {name: {port for _, port, _ in _listening(x)} for name, x in (("first", lab), ("second", second_lab))}
    assert ports["first"] and ports["second"] and not ports["first"] & ports["second"]
    assert lab.engines.port != second_lab.engines.port
    for x, cfg in ((lab, ParallelConfig(dp=4)), (second_lab, ParallelConfig(dp=2)), (lab, ParallelConfig(dp=2))):
        assert_matches(x.run(cfg, model=TINY, steps=3, return_params=True), ref_cache())
    after = {port for _, port, _ in _listening(second_lab)}
    assert not after & {port for _, port, _ in _listening(lab)}
