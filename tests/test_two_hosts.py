"""Two real hosts on one box (scripts/netns-hosts.sh): labkit-a (the notebook's network namespace)
and labkit-b (its own), each with its own host name and address, joined by a veth pair. ipyparallel's
ssh launcher starts two engines on each (its ssh is the script's, which enters the host's
namespaces), so the ranks of the two hosts talk over a non-loopback link whose counters say what
crossed it. One Lab for the module; the tests that kill engines come last."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import time

import psutil
import pytest
from conftest import TINY
from launch_tools import link_stats, two_hosts  # noqa: F401  (two_hosts: a fixture)

from labkit import EngineDied, LabError, ModelConfig, ParallelConfig
from labkit.layout.mesh import MeshLayout
from labkit.oracle.checks import assert_matches

pytestmark = pytest.mark.slow

A, B = "10.213.0.1", "10.213.0.2"
LINK_A, LINK_B = "lk21a0", "lk21b0"
HOSTS = ["labkit-a", "labkit-a", "labkit-b", "labkit-b"]
WIDER = ModelConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=128, seq=16)
"""Wide enough that the gradients, not the Lab's own messages, are what crosses the link."""


@pytest.fixture(scope="module")
def lab2(two_hosts):  # noqa: F811
    from labkit import Lab

    t0 = time.perf_counter()
    lab = Lab(
        engines=4,
        launcher="ssh",
        hosts={"labkit-a": 2, "labkit-b": 2},
        ssh_cmd=[str(two_hosts), "ssh"],
        scp_cmd=[str(two_hosts), "scp"],
        controller_ip=A,
        device="cpu",
        progress=False,
        timeout=120,
    )
    print(f"\nssh: Lab(engines=4) on two hosts started in {time.perf_counter() - t0:.1f} s")
    try:
        yield lab
    finally:
        lab.close()


def _ifname():
    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")


def test_two_hosts_each_on_its_own_interface_and_the_mesh_knows(lab2, ref_cache):
    assert lab2.hosts == HOSTS  # host by host: neighbouring ranks share one
    assert lab2.apply(_ifname) == [(LINK_A, LINK_A)] * 2 + [(LINK_B, LINK_B)] * 2  # each host's own link
    cfg = ParallelConfig(dp=2, tp=2)
    axes = {a["dim"]: a for a in MeshLayout.of(cfg).axes(lab2.hosts)}
    assert axes["tp"]["spans_hosts"] == [] and axes["tp"]["warning"] is None
    assert axes["dp"]["spans_hosts"] == [[0, 2], [1, 3]]  # dp reduces across the link, which it tolerates
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for this layout
        res = lab2.run(cfg, model=TINY, steps=3, return_params=True)
    assert_matches(res, ref_cache())


def test_tp_across_hosts_is_warned_and_still_trains_right(lab2, ref_cache):
    cfg = ParallelConfig(dp=2, tp=2, order="dp-tp-cp-ep-pp")  # dp innermost: each tp group spans the hosts
    (axis,) = [a for a in MeshLayout.of(cfg).axes(lab2.hosts) if a["dim"] == "tp"]
    assert axis["spans_hosts"] == [[0, 2], [1, 3]]
    with pytest.warns(UserWarning, match=r"tp=2 groups span hosts .* \['labkit-a', 'labkit-b'\]"):
        res = lab2.run(cfg, model=TINY, steps=3, return_params=True)
    assert_matches(res, ref_cache())


def test_every_listener_is_on_the_cluster_link_or_loopback(lab2):
    lab2.run(ParallelConfig(dp=2, tp=2), model=TINY, steps=1)  # gloo's groups up
    seen = []
    for p in lab2.engines.processes():
        for c in p.net_connections("inet"):
            if c.status == psutil.CONN_LISTEN:
                seen.append((c.laddr.ip, c.laddr.port, p.pid))
    print(f"\n{len(seen)} listening sockets: {sorted({ip for ip, _, _ in seen})}")
    assert seen, "no listening socket found: the check would prove nothing"
    assert not [s for s in seen if s[0] in ("0.0.0.0", "::")], "a listener on every interface"
    assert {ip for ip, _, _ in seen} <= {A, B, "127.0.0.1", "::1"}
    controller = lab2.engines.cluster.controller.pid
    outside = {ip for ip, _, pid in seen if pid == controller} - {"127.0.0.1"}  # its monitor: this host only
    assert outside == {A}  # what the engines reach: the link only
    assert {ip for ip, _, pid in seen if pid in lab2.engines.pids[2:]} <= {B, "127.0.0.1"}  # B's ranks: B's side
    assert not [s for s in seen if s[1] == lab2.engines.port], "the rendezvous store still takes connections"


def _crossing(res, hosts) -> dict[str, float]:
    """Ring-model bytes per dim that the last step sent from labkit-a to labkit-b: each rank sends to
    the next rank of its group's ring (gloo's order), so a send crosses where that rank is on b."""
    out: dict[str, float] = {}
    for rk in res.ranks:
        if hosts[rk.rank] != "labkit-a":
            continue
        for e in rk.comm:
            if e.step != res.steps - 1 or len(e.group) < 2:
                continue
            nxt = e.group[(e.group.index(rk.rank) + 1) % len(e.group)]
            if hosts[nxt] == "labkit-b":
                out[e.dim] = out.get(e.dim, 0.0) + e.wire_bytes
    return out


def test_what_the_link_carries_per_step(lab2):
    cfg = ParallelConfig(dp=2, tp=2)
    sent = {}
    for steps in (1, 3):
        lab2.run(cfg, model=WIDER, steps=1)  # warm: the layout's groups exist before counting
        before = link_stats()[LINK_A]
        res = lab2.run(cfg, model=WIDER, steps=steps)
        after = link_stats()[LINK_A]
        sent[steps] = {k: after[k] - before[k] for k in after}
    per_step = {k: (sent[3][k] - sent[1][k]) / 2 for k in sent[3]}
    meter = _crossing(res, lab2.hosts)
    ratio = per_step["tx_bytes"] / sum(meter.values())
    print(
        f"\nper step over the link a->b: {per_step['tx_bytes'] / 1e3:.1f} kB in {per_step['tx_packets']:.0f} packets; "
        f"b->a {per_step['rx_bytes'] / 1e3:.1f} kB; the comm meter's ring-model bytes crossing a->b: "
        f"{ {d: round(b / 1e3, 1) for d, b in meter.items()} } kB; link / meter = {ratio:.3f}"
    )
    assert set(meter) == {"dp"}  # tp stays on each host
    # the link carries the algorithm's bytes plus 66 B of headers per packet (at most 5% at MTU
    # 1500; a veth counts GSO packets, ~12 kB each here: <1%), acknowledgements of b's data and the
    # Lab's polls of b's engines (DERIVATIONS.md, "What a link between hosts carries": measured 1.014)
    assert 1.0 <= ratio < 1.25


def test_hierarchical_cp_keeps_its_all_to_alls_on_each_host(lab2, ref_cache):
    """cp=4 over the two hosts, all-to-alls over runs of 2 (the hierarchical kind's a2a+p2p): each run is one host's
    two ranks, so only the ring's hops (and the gradients' all-reduce) cross the link; Ulysses over all
    four ranks sends its all-to-alls across."""
    runs = ParallelConfig(cp=4, cp_kind="hierarchical", cp_a2a=2)
    res = lab2.run(runs, model=TINY, steps=3, return_params=True)
    assert_matches(res, ref_cache())
    hosts = lab2.hosts
    spans = lambda group: len({hosts[r] for r in group}) > 1  # noqa: E731
    events = [e for rk in res.ranks for e in rk.comm if e.step == res.steps - 1]
    a2a = [e for e in events if e.op == "all_to_all"]
    hops = [(rk.rank, e.peer) for rk in res.ranks for e in rk.comm if e.op == "send" and e.step == res.steps - 1]
    assert a2a and not [e for e in a2a if spans(e.group)]  # every all-to-all inside a host
    assert hops and all(hosts[a] != hosts[b] for a, b in hops)  # every ring hop across the link
    flat = lab2.run(runs.replace(cp_kind="ulysses", cp_a2a=1), model=TINY, steps=1)
    assert all(spans(e.group) for rk in flat.ranks for e in rk.comm if e.op == "all_to_all")


def test_a_script_on_two_hosts_is_two_torchrun_nodes(lab2, tmp_path):
    """lab.torchrun on engines the ssh launcher started: each host a torchrun node (GROUP_RANK, LOCAL_RANK
    host by host), the store on rank 0's host at its cluster address, which labkit-b's ranks reach over the link."""
    scripts = pathlib.Path(__file__).parent / "data" / "scripts"
    res = lab2.torchrun(str(scripts / "contract.py"), str(tmp_path), echo=False)  # the hosts share the files
    seen = [json.loads((tmp_path / f"{r}.json").read_text())["env"] for r in range(4)]
    assert res.ok and [rk.host for rk in res.ranks] == HOSTS
    assert [(e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) for e in seen] == [
        ("0", "0", "0"),
        ("1", "1", "0"),
        ("2", "0", "1"),
        ("3", "1", "1"),
    ]
    assert {(e["MASTER_ADDR"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["WORLD_SIZE"]) for e in seen} == {
        (A, "2", "2", "4")
    }
    assert all([e.op for e in rk.comm if e.op == "barrier"] == ["barrier"] for rk in res.ranks)
    assert "--nnodes=2 --nproc-per-node=2" in res.command


def test_a_dead_hosts_engines_are_named_and_replaced_on_that_host(lab2, ref_cache):
    victims = lab2.engines.pids[2:]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDied, match="on host labkit-b"):
        lab2.run(ParallelConfig(dp=4), model=TINY, steps=3)
    res = lab2.run(ParallelConfig(dp=4), model=TINY, steps=3, return_params=True)  # repaired first
    assert_matches(res, ref_cache())
    assert lab2.hosts == HOSTS and not set(victims) & set(lab2.engines.pids)
    assert list(lab2.repairs[-1]["replaced"]) == [2, 3]


def test_a_host_that_is_gone_is_said_to_be(lab2, monkeypatch):
    monkeypatch.setenv("LABKIT_NETNS_DOWN", "labkit-b")  # ssh to labkit-b now fails as to a dead host
    for pid in lab2.engines.pids[2:]:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineDied, match="on host labkit-b"):
        lab2.run(ParallelConfig(dp=4), model=TINY, steps=1)
    with pytest.raises(LabError, match="could not repair itself.*labkit-b"):
        lab2.run(ParallelConfig(dp=4), model=TINY, steps=1)
