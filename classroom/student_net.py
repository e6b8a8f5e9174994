"""A student's network: a namespace of their own, one veth link to the host, and a firewall on it.

The namespace makes the student's 127.0.0.1 theirs alone (classroom/README.md says why). The link is
one /30 per student, with no default route: the student's side reaches the host's end and nothing
else. The host's end is still the host, though: every service the host runs on 0.0.0.0 or :: answers
there (over IPv4, and over the link's IPv6 link-local addresses, which the kernel gives every veth),
so an nftables table per student drops whatever arrives from the link but the replies to what the
host opened (the proxy's connections to the server) and new connections to the hub's API port.

Everything is named by the hub's veth prefix and the student's slot or name, and removed by those
exact names: nothing here lists namespaces, links or tables by a pattern.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import subprocess

CLONE_NEWNET = 0x40000000  # <sched.h>: setns() into a network namespace
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child after fork calls setns through it


def link(network: str, slot: int) -> tuple[str, str, str]:
    """(host end, student end, prefix) of slot's /30 in `network`: slot 1 of 10.44.0.0/16 is
    10.44.0.5 (the hub's side) and 10.44.0.6 (the student's); slot 0's /30 is never used."""
    net = ipaddress.ip_network(network)
    if net.version != 4 or net.prefixlen > 28:
        raise ValueError(f"network={network!r}: give an IPv4 network of /28 or wider (each student takes a /30)")
    if not 1 <= slot < net.num_addresses // 4:
        raise ValueError(f"slot {slot}: network={network} has room for {net.num_addresses // 4 - 1} students")
    base = net.network_address + 4 * slot
    return str(base + 1), str(base + 2), "30"


def ends(veth: str, slot: int) -> tuple[str, str]:
    """The link's interface names: (the host's end, the student's end)."""
    return f"{veth}{slot}h", f"{veth}{slot}s"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def netns_up(name: str, slot: int, network: str, veth: str, hub_port: int) -> tuple[str, str]:
    """Network namespace `name` with loopback up, one veth to the host, and the link's firewall:
    (host end, student end). Refuses, naming it, a namespace of that name that exists already
    (the caller removes what it knows to be its own first: ClassroomSpawner's saved state)."""
    if os.path.exists(f"/run/netns/{name}"):
        raise RuntimeError(
            f"a network namespace {name} exists and this hub did not record making it: "
            f"if it is a dead hub's, remove it (ip netns del {name}); else choose another ClassroomSpawner.veth"
        )
    host, student, prefix = link(network, slot)
    outside, inside = ends(veth, slot)
    ip("netns", "add", name)
    try:
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", name)
        ip("addr", "add", f"{host}/{prefix}", "dev", outside)
        firewall_up(veth, slot, host, hub_port)  # before the link is up: no moment without it
        ip("link", "set", outside, "up")
        ip("-n", name, "addr", "add", f"{student}/{prefix}", "dev", inside)
        ip("-n", name, "link", "set", inside, "up")
        ip("-n", name, "link", "set", "lo", "up")
    except BaseException:  # what this call made goes (a link of that name that was there before stays)
        ip("netns", "del", name, check=False)
        firewall_down(veth, slot)
        raise
    return host, student


def netns_down(name: str, slot: int, veth: str) -> None:
    """Remove what netns_up made for `name` and `slot` (each by its own name; gone already is fine)."""
    ip("link", "del", ends(veth, slot)[0], check=False)  # its peer goes with it
    ip("netns", "del", name, check=False)
    firewall_down(veth, slot)


def join_netns(path: str) -> None:
    """Move this process into the network namespace at `path` (needs CAP_SYS_ADMIN: before setuid)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


# -- the firewall on the student's link ------------------------------------------------------------
def table(veth: str, slot: int) -> str:
    """The nftables table of slot's link (family inet: IPv4 and IPv6 alike)."""
    return f"labkit_{veth}{slot}"


def rules(veth: str, slot: int, host: str, hub_port: int) -> str:
    """What the host accepts from the student's link: replies to connections the host opened (the
    proxy's and the hub's to the server) and new connections to the hub's API on the host's end;
    nothing else, of either IP version, and nothing forwarded to or from the link. Priority -10:
    before a distribution's own filter chains; a drop here is final whatever they accept."""
    outside = ends(veth, slot)[0]
    return f"""
table inet {table(veth, slot)} {{
    chain input {{
        type filter hook input priority -10; policy accept;
        iifname "{outside}" ct state established,related accept
        iifname "{outside}" ip daddr {host} tcp dport {hub_port} ct state new accept
        iifname "{outside}" drop
    }}
    chain forward {{
        type filter hook forward priority -10; policy accept;
        iifname "{outside}" drop
        oifname "{outside}" drop
    }}
}}
"""


def firewall_up(veth: str, slot: int, host: str, hub_port: int) -> None:
    nft = shutil.which("nft")
    if nft is None:
        raise RuntimeError("the classroom's firewall needs nftables' nft (apt-get install nftables)")
    got = subprocess.run(
        [nft, "-f", "-"], input=rules(veth, slot, host, hub_port), capture_output=True, text=True, timeout=30
    )
    if got.returncode != 0:
        raise RuntimeError(f"nft: the firewall of {ends(veth, slot)[0]} was refused: {got.stderr.strip()}")


def firewall_down(veth: str, slot: int) -> None:
    nft = shutil.which("nft")
    if nft:
        subprocess.run([nft, "delete", "table", "inet", table(veth, slot)], capture_output=True, timeout=30)
