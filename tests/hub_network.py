"""Student B's attacks over the network on student A's Lab, for tests/test_classroom_hub.py: the
hub's configs (the plain spawner's and the classroom's, with the test's ports and students), the
cells A and B run, and the judge of what B got (hub_attacks.py holds B's code itself)."""

from __future__ import annotations

import glob
import pathlib
import time

from hub_tools import Hub, Kernel

ATTACKS = (pathlib.Path(__file__).parent / "hub_attacks.py").read_text()

COMMON = """
load_subconfig("{classroom}/jupyterhub_config.py")
c.JupyterHub.bind_url = "http://127.0.0.1:{public}"
c.JupyterHub.hub_bind_url = "http://0.0.0.0:{hub}"
c.JupyterHub.hub_connect_url = "http://127.0.0.1:{hub}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.ConfigurableHTTPProxy.command = ["{chp}"]
c.JupyterHub.db_url = "sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{state}/jupyterhub_cookie_secret"
c.PAMAuthenticator.allowed_groups = {{"{group}"}}
c.Authenticator.admin_users = set()
c.JupyterHub.services.append({{"name": "labkit-test", "api_token": "{token}"}})
c.JupyterHub.load_roles.append({{
    "name": "labkit-test",
    "scopes": ["admin:users", "admin:servers", "tokens", "access:servers", "list:users", "read:users"],
    "services": ["labkit-test"],
}})
"""
"""The classroom's own config, with this test's ports, state, students and admin service."""
PLAIN = (
    COMMON
    + """
from jupyterhub.spawner import LocalProcessSpawner
c.JupyterHub.spawner_class = LocalProcessSpawner   # one Unix user per student, one shared 127.0.0.1
"""
)
CLASSROOM = (
    COMMON
    + """
c.ClassroomSpawner.network = "{network}"
c.ClassroomSpawner.veth = "{veth}"
c.ClassroomSpawner.cores_per_student = 1           # 2 cores, 3 students: cores 0, 1, 0
c.ClassroomSpawner.sweep_grace_s = 3.0
"""
)

LAB_WORK = """
import json, os, psutil
from ipykernel import get_connection_file
from labkit import Lab, ModelConfig, ParallelConfig, reference, theory
from labkit.engines import sockets
from labkit.oracle.checks import assert_matches

model = ModelConfig(layers=2, hidden=32, heads=4, ffn=128, vocab=256, seq=16)
lab = Lab(engines=2, device="cpu", progress=False, timeout=120)
cfg = ParallelConfig(dp=2)
res = lab.run(cfg, model=model, steps=3, data="text")
ref = reference(model, steps=3, global_batch=cfg.global_batch, data="text")
assert_matches(res, ref)
assert res.comm_table() == theory.estimate(cfg, model).comm_table()
listening = lambda pid: sorted({c.laddr.port for c in psutil.Process(pid).net_connections("inet")
                                if c.status == psutil.CONN_LISTEN})
print("RESULT " + json.dumps({
    "repr": repr(lab), "share": list(lab.share), "losses": res.losses, "reference": ref.losses,
    "kernel": os.getpid(), "engines": lab.engines.pids, "store": lab.engines.port,
    "gloo": sorted({p for rank in lab.apply(sockets.listening) for _, p in rank} - {lab.engines.port}),
    "controller": listening(lab.engines.cluster.controller.pid), "controller_pid": lab.engines.cluster.controller.pid,
    "iopub": json.load(open(get_connection_file()))["iopub_port"], "connection_file": get_connection_file(),
    "profile": lab.engines.cluster.profile_dir, "cluster_id": lab.engines.cluster.cluster_id,
    "netns": os.readlink("/proc/self/ns/net"), "cores": sorted(os.sched_getaffinity(0)),
    "addrs": [a.address for n, found in psutil.net_if_addrs().items() for a in found
              if a.family == 2 and not a.address.startswith("127.")],
    "labkit": __import__("labkit").__file__,
}))
"""
"""A's cell: notebook 00's kind of work (a Lab, a run on text, checked against the one-process
reference and the theory), then where its Lab listens and keeps its files."""

STRAY = """
import subprocess
stray = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a student's job, detached
print("RESULT " + json.dumps(stray.pid))
"""
"""A's own process, detached from the kernel (as `nohup python train.py &` from a terminal is)."""

PROBE = """
def _probe(written, ports_of_b):
    import psutil
    from labkit.engines import process_group, sockets
    mine = {p for _, p in sockets.listening()}
    held = [c for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_ESTABLISHED
            and c.laddr.port in mine and c.raddr and c.raddr.port in ports_of_b]
    return {"store_has_b_key": bool(process_group._store.check([written])), "connections_from_b": len(held)}
print("RESULT " + json.dumps(lab.apply(_probe, WRITTEN, set(PORTS_OF_B))))
"""
"""A's ranks look at what B left: B's key in their rendezvous store, B's connections to their gloo listeners."""


def attack(students, a_kernel: Kernel, info: dict, b_kernel: Kernel) -> dict:
    """B's attacks on A's Lab (A's cell has run and told `info`; B's store catcher ran through it):
    what B got, and what A's ranks found B had done."""
    a = students.names[0]
    stores = b_kernel.result("print('RESULT ' + json.dumps(catcher.report()))")
    hosts = ["127.0.0.1", *info["addrs"]]  # A's loopback, and A's own link's address where it has one
    b_kernel.run(f"listener = Listener({[*info['controller'], info['iopub']]}, {hosts})")
    time.sleep(1.0)  # ZMQ subscriptions take a moment to reach the publisher
    marker = f"secret-of-{a}-{time.time_ns()}"
    a_kernel.run(f"lab.apply(print, {marker!r}); print({marker!r})")
    heard = b_kernel.result(f"print('RESULT ' + json.dumps(listener.heard({marker!r}, 2.0)))")
    knocked = b_kernel.result(f"print('RESULT ' + json.dumps(knock({[info['store'], *info['gloo']]}, {hosts})))")
    ports_of_b = [v for v in knocked.values() if isinstance(v, int)]
    effects = a_kernel.result(f"WRITTEN = {'written-by-student-b'!r}; PORTS_OF_B = {ports_of_b}\n" + PROBE)
    logs = sorted(glob.glob(f"{info['profile']}/log/*.log"))
    files = [info["connection_file"], f"{info['profile']}/security", f"{info['profile']}/log", *logs]
    read = b_kernel.result(f"print('RESULT ' + json.dumps(read({files})))")
    return {
        "a_listens": sorted({info["store"], *info["gloo"], *info["controller"], info["iopub"]}),
        "b_saw_ports": stores["ports_seen"],
        "b_caught_store": info["store"] in stores["stores"],
        "store_keys_b_read": stores["keys"].get(str(info["store"]), []),
        "a_store_has_b_key": any(e["store_has_b_key"] for e in effects),
        "b_heard_a_engines": any(k.endswith(f":{p}") for k in heard["carried_marker"] for p in info["controller"]),
        "b_heard_a_notebook": any(k.endswith(f":{info['iopub']}") for k in heard["carried_marker"]),
        "a_gloo_accepted_b": sum(e["connections_from_b"] for e in effects),
        "knocks": knocked,
        "b_read": {path: got for path, got in read.items() if got.startswith(("read", "listed"))},
        "b_refused": {path: got for path, got in read.items() if not got.startswith(("read", "listed"))},
        "logs": logs,
    }


def setup_b(hub: Hub, students) -> Kernel:
    b_kernel = hub.kernel(students.names[1])
    b_kernel.run(ATTACKS + "\nimport json")
    b_kernel.run(f"catcher = StoreCatcher({students.uid(students.names[0])})")
    return b_kernel


def lab_work(kernel: Kernel) -> dict:
    return kernel.result(LAB_WORK, timeout=400)
