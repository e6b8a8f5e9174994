"""The classroom for real (classroom/): a JupyterHub started here, with its proxy
(configurable-http-proxy from npm) and three Unix users created here, each student's server started
through the hub's REST API and a kernel of theirs running notebook 00's kind of Lab work.

First the measurement that says why the classroom needs its spawner: the same hub with JupyterHub's
plain LocalProcessSpawner (one Unix user per student, one shared 127.0.0.1), where student B's
kernel reaches student A's Lab: B catches A's rendezvous store while the ranks meet and writes a
key A's ranks then read, reads A's engines' and notebook's output off their PUB sockets, has its
connections accepted by A's gloo listeners, and reads A's engine logs. Then the classroom as
shipped (classroom_spawner.ClassroomSpawner: a network namespace per student, private homes):
three Labs at once, each exact; every one of those attacks refused, judged by the same effects on
A; the teacher's `labkit who`; a server the hub stops leaves no process of its user.

Then what students share besides the network (tests/hub_space.py), on the same two hubs: B squats
A's torch compile cache in /tmp with a precompiled header of B's, and A's compiled Lab runs B's code
as A; B reads A's sockets and command lines in /proc and forges an engine of A's Lab for the census;
B reaches a service the host runs on every interface; B widens its cores; B leaves a process that
forks on SIGTERM, a shared-memory segment and temporary files to outlive its server's stop. Each
works on the plain spawner, and none on the classroom's.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

import psutil
import pytest
from hub_network import CLASSROOM, PLAIN, STRAY, attack, lab_work, setup_b
from hub_probes import HostService, cgroup_dirs, link_local
from hub_space import clean_after, compile_squat, dump, snoop_and_forge, stay_and_stop
from hub_tools import ROOT, Hub, Students, check_students_can_run, need_hub
from student_net import link

from labkit.cluster import census
from labkit.cluster.footprint import by_role, footprint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chp():
    return need_hub()


@pytest.fixture(scope="module")
def service():
    """A service of the host's on every address (IPv4 and IPv6), for B to try to reach."""
    made = HostService()
    yield made
    made.close()


@pytest.fixture(scope="module")
def students(chp):
    """Three Unix users (a, b, c) who can run this Python and labkit; removed afterwards with
    whatever processes they still have."""
    made = Students(3)
    scratch = tempfile.mkdtemp(prefix="labkit-hub-")
    try:
        check_students_can_run(made.names[0], scratch)
        yield made
    finally:
        made.remove()
        shutil.rmtree(scratch, ignore_errors=True)


def _hub(config: str, students, chp, **fill) -> Hub:
    state = pathlib.Path(tempfile.mkdtemp(prefix="labkit-hub-"))  # 0700: the hub's database and secret
    hub = Hub(config, state, chp, group=students.group, **fill)
    hub.api("POST", "/users", {"usernames": students.names})
    return hub


@pytest.fixture(scope="module")
def before(students, chp, service):
    """The measurement on JupyterHub's plain LocalProcessSpawner: what B's kernel does to A's Lab.
    That hub and what its students ran and left are gone before the classroom's starts."""
    hub = _hub(PLAIN, students, chp)
    a, b = students.names[:2]
    try:
        t0 = time.monotonic()
        hub.start(a, b)
        b_kernel = setup_b(hub, students)  # B watches for A's listeners before A's Lab starts
        a_kernel = hub.kernel(a)
        info = lab_work(a_kernel)
        got = attack(students, a_kernel, info, b_kernel)
        got["compile"] = compile_squat(students, a_kernel, b_kernel)
        got["space"] = snoop_and_forge(info, b_kernel, service, [("127.0.0.1", service.port), ("::1", service.port)])
        got["stray"] = a_kernel.result(STRAY)
        hub.stop(a)  # the plain spawner ends the server; what of A's is left after it?
        time.sleep(3.0)  # as long as the classroom's sweep gives the kernel's Lab to end by itself (sweep_grace_s)
        got["left_after_stop"] = students.end_processes(a)
        got["stay"] = stay_and_stop(hub, students, b_kernel)
        got["seconds"] = time.monotonic() - t0
    finally:
        hub.close()
        cleaned = clean_after(students, f"/tmp/torchinductor_{a}", f"/tmp/lk-drop-{students.tag}")
    got["cleaned"] = cleaned
    return got


def test_on_a_plain_local_process_spawner_student_b_reaches_student_a(before):
    print(f"\nbefore (LocalProcessSpawner), {before['seconds']:.0f} s: " + json.dumps(before, indent=1))
    assert before["b_saw_ports"], "B saw none of A's listening ports in /proc/net/tcp"
    assert before["b_caught_store"], "B did not catch A's rendezvous store while the ranks met"
    assert before["a_store_has_b_key"], "A's ranks did not find the key B wrote"
    assert [k for k in before["store_keys_b_read"] if "cpu" in k], "B did not read A's gloo addresses from the store"
    assert before["b_heard_a_engines"], "B did not hear A's engines' output on the controller's PUB socket"
    assert before["b_heard_a_notebook"], "B did not hear A's notebook's output on its kernel's iopub"
    assert before["a_gloo_accepted_b"] >= 1, "A's gloo listeners accepted none of B's connections"
    assert [p for p in before["b_read"] if p.endswith(".log")], "B read none of A's engine logs"
    # what ipyparallel and Jupyter already held before the classroom: their keys, 0600 in a 0700 directory
    assert set(before["b_refused"]) >= {before["logs"][0].rsplit("/log/", 1)[0] + "/security"}
    assert [p for p in before["b_refused"] if p.endswith(".json")], "B read A's kernel connection file"
    # a stop ends the server, its kernel and its Lab (labkit's watchdog), but not A's own detached job
    assert [line for line in before["left_after_stop"] if line.startswith(f"{before['stray']} ")]


@pytest.fixture(scope="module")
def classroom(students, chp, before, service):
    """The classroom as shipped (a network namespace per student, private homes, a core each),
    after the plain hub is gone: the three students' Labs at once, then B's attacks on A."""
    net = f"10.44.{int(students.tag, 16) % 250}.0/24"
    veth = f"lk{students.tag[:4]}"
    hub = _hub(CLASSROOM, students, chp, network=net, veth=veth)
    try:
        t0 = time.monotonic()
        hub.start(*students.names)
        b_kernel = setup_b(hub, students)
        kernels = [hub.kernel(students.names[0]), b_kernel, hub.kernel(students.names[2])]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            infos = dict(zip(students.names, pool.map(lab_work, kernels)))
        ran = time.monotonic() - t0
        held = {name: _held(students, name, infos[name]) for name in students.names}
        got = attack(students, kernels[0], infos[students.names[0]], b_kernel)
        labs = census.labs()
        got["compile"] = compile_squat(students, kernels[0], b_kernel)
        slot_b = _slots(hub)[students.names[1]]
        host = link(net, slot_b)[0]  # the host's end of B's link: the host, as B's namespace reaches it
        ll = f"{link_local(f'{veth}{slot_b}h')}%{veth}{slot_b}s"  # the same over IPv6, link-local
        targets = [(host, service.port), (ll, service.port), (host, hub.ports["hub"])]
        got["space"] = snoop_and_forge(infos[students.names[0]], b_kernel, service, targets)
        got["space"]["targets"] = targets
        got["space"]["b_cgroups"] = cgroup_dirs(infos[students.names[1]]["kernel"])
        yield {
            **{"hub": hub, "infos": infos, "attacks": got, "census": labs, "kernels": kernels},
            **{"ran": ran, "veth": veth, "held": held, "slot_b": slot_b},
        }
    finally:
        hub.close()


def test_three_students_labs_run_at_once_each_exact_on_its_share(classroom, students):
    infos = classroom["infos"]
    print(f"\nthree Labs at once through the hub, {classroom['ran']:.0f} s from the first server's start")
    hub_cores = sorted(os.sched_getaffinity(0))
    netns = set()
    slots = _slots(classroom["hub"])
    assert sorted(slots[n] for n in students.names) == [1, 2, 3]
    for name in students.names:
        slot, info = slots[name], infos[name]
        print(f"  {name}: {info['repr']}")
        assert info["losses"] == pytest.approx(info["reference"], rel=1e-5)  # assert_matches held in the kernel too
        assert info["labkit"].startswith(str(ROOT))  # the students run this checkout's labkit
        want = [hub_cores[(slot - 1) % len(hub_cores)]]  # cores_per_student = 1, handed out by slot
        assert info["cores"] == want
        (share,) = info["share"]
        assert share["cores"] == str(want[0]) and share["threads per engine"] == 1 and share["engines"] == 2
        assert f"share='cores {want[0]} (CPU affinity): 1 thread(s) x 2 engines'" in info["repr"]
        netns.add(info["netns"])
    assert len(netns) == 3 and os.readlink("/proc/self/ns/net") not in netns  # a namespace each, none the host's


def test_every_attack_of_student_b_on_student_a_is_refused(classroom, before):
    after = classroom["attacks"]
    rows = [
        ("A's listening ports B sees in /proc/net/tcp", len(before["b_saw_ports"]), len(after["b_saw_ports"])),
        ("B caught A's rendezvous store", before["b_caught_store"], after["b_caught_store"]),
        ("A's ranks read the key B wrote", before["a_store_has_b_key"], after["a_store_has_b_key"]),
        ("B heard A's engines (ipyparallel iopub)", before["b_heard_a_engines"], after["b_heard_a_engines"]),
        ("B heard A's notebook (kernel iopub)", before["b_heard_a_notebook"], after["b_heard_a_notebook"]),
        ("B's connections A's gloo listeners accepted", before["a_gloo_accepted_b"], after["a_gloo_accepted_b"]),
        ("A's files B read (logs)", len(before["b_read"]), len(after["b_read"])),
    ]
    print("\n" + "\n".join(f"  {what:48s} before {b!s:6s} after {a}" for what, b, a in rows))
    print("  B's knocks after: " + json.dumps(after["knocks"]))
    assert after["b_saw_ports"] == []  # B's /proc/net/tcp is B's namespace's: none of A's sockets
    assert not after["b_caught_store"] and not after["a_store_has_b_key"]
    assert not after["b_heard_a_engines"] and not after["b_heard_a_notebook"]
    assert after["a_gloo_accepted_b"] == 0
    a_link = [k for k in after["knocks"] if not k.startswith("127.")]
    assert a_link and all("unreachable" in str(after["knocks"][k]) for k in a_link)  # no route to A's link
    assert after["b_read"] == {} and after["logs"]  # A's logs exist; B reads none of them
    for before_value, after_value in [(b, a) for _, b, a in rows]:
        assert before_value and not after_value  # each attack worked before, and none after


def test_the_teacher_sees_who_holds_which_engines_and_cores(classroom, students):
    rows = {r["user"]: r for r in classroom["census"]}
    print("\n" + census.table(classroom["census"]))
    for name in students.names:
        info = classroom["infos"][name]
        row = rows[name]
        assert row["kernel"] == info["kernel"] and row["engines"] == 2
        assert sorted(map(int, row["engine pids"].split())) == sorted(info["engines"])
        assert row["cores"] == ",".join(map(str, info["cores"])) and row["netns"] == info["netns"]
        assert row["memory is"] == "PSS" and row["memory MiB"] > 100  # a kernel with torch, two engines
        print(f"  {name} holds, MiB by role: {classroom['held'][name]}")


def _held(students, name: str, info: dict) -> dict:
    """What a student's processes hold (server, kernel, Lab): by role, MiB of RSS, USS and PSS."""
    pids = [p.pid for p in students.processes(name)]
    rows = footprint(pids, info["engines"], controller=info["controller_pid"], kernel=info["kernel"])
    return {
        role: {k: v if k == "count" else round(v / 2**20) for k, v in acc.items()}
        for role, acc in by_role(rows).items()
    }


def test_a_server_the_hub_stops_leaves_no_process_of_its_student(classroom, students):
    hub, (a, b, _) = classroom["hub"], students.names
    culler = [p for p in psutil.Process(hub.proc.pid).children(recursive=True) if "jupyterhub_idle_culler" in _cmd(p)]
    assert culler, "the idle culler (a service of classroom/jupyterhub_config.py) is not running under the hub"
    stray = classroom["kernels"][0].result(STRAY)
    assert stray in [p.pid for p in students.processes(a)]
    namespaces = f"/proc/{hub.proc.pid}/root/run/netns"  # the hub's view: it may have a mount namespace of its own
    link = f"{classroom['veth']}{_slots(hub)[a]}h"  # A's end of its link, on the host
    assert f"labkit-{a}" in os.listdir(namespaces) and _has_link(link)
    hub.stop(a)  # the admin's stop button; the idle culler's request is the same
    left = students.processes(a)
    swept = [line for line in hub.log(60000).splitlines() if f"{a} stopped:" in line]
    print(f"\n{a}'s stop, the spawner's sweep: {swept[-1].split('stopped:', 1)[1] if swept else '(none logged)'}")
    assert left == [], [(p.pid, _cmd(p)) for p in left]
    assert swept and f"'{stray} " in swept[-1]  # the detached job was the sweep's to end
    assert f"labkit-{a}" not in os.listdir(namespaces) and not _has_link(link)
    # the others' Labs go on: B's runs again, exact
    again = classroom["kernels"][1].result(
        "res = lab.run(cfg, model=model, steps=3, data='text'); assert_matches(res, ref)\n"
        "print('RESULT ' + json.dumps(res.losses))"
    )
    assert again == pytest.approx(classroom["infos"][b]["losses"], rel=1e-6)


def _cmd(p: psutil.Process) -> list[str]:
    """Its command line; [] for a process gone, or a zombie (a student's ended child, not yet reaped)."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _slots(hub: Hub) -> dict[str, int]:
    """user -> slot, as the classroom's spawner logged them ('NAME: slot N, netns ...')."""
    return {m[1]: int(m[2]) for m in re.finditer(r"(\S+): slot (\d+), netns", hub.log(10**7))}


def _has_link(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


# -- what students share besides the network (tests/hub_space.py) ---------------------------------
def _engines_planted(compiled: dict) -> list[bool]:
    return [e["planted"] for e in compiled["engines"]]


def test_on_a_plain_spawner_b_runs_code_as_a_sees_a_in_proc_and_outlives_its_stop(before, students):
    a = students.names[0]
    squat, space, stay = before["compile"], before["space"], before["stay"]
    dump(
        "before (LocalProcessSpawner): B's compile cache squat, /proc, census, host service, a stop", before["cleaned"]
    )
    dump("squat", squat)
    dump("space", space)
    dump("stay", stay)
    # B's header was built into A's engines' kernels: B's code ran as A, and B holds A's token
    assert _engines_planted(squat["compiled"]) == [True, True]
    assert squat["b_got"] == {str(students.uid(a)): a}  # the hub's API says the token B got is A's
    # /proc: A's sockets (a namespace's every listener), A's command lines, A's Lab's tag
    listed = [v for k, v in space["snooped"]["read"].items() if k.endswith("net/tcp")]
    assert listed and all(v.startswith("listed ") and v != "listed 0 listeners" for v in listed)
    assert all(v.startswith("read ") for k, v in space["snooped"]["read"].items() if k.endswith("cmdline"))
    assert space["tag_seen"] and space["forged"] in space["by_tag_alone"]  # the tag alone would count B's
    (row,) = space["a_row"]
    assert row["engines"] == 2 and str(space["forged"]) not in row["engine pids"].split()  # the census holds
    assert all(v.startswith("connected: a host service") for v in space["reached"].values())
    assert len(space["service_served"]) == 2
    assert space["cores"] == sorted(os.sched_getaffinity(0))  # every core B asks for
    # B's stop: the plain spawner ends the server, not what B left
    assert stay["after"]["processes"] and stay["after"]["shm"] == stay["before"]["shm"] != []
    assert {f"{d}/lk-stay-{students.tag}" for d in ("/tmp", "/var/tmp", "/dev/shm")} <= set(stay["after"]["files"])


def test_b_plants_nothing_in_the_compile_cache_of_a(classroom, before, students):
    a = students.names[0]
    squat = classroom["attacks"]["compile"]
    dump("after (ClassroomSpawner): B's compile cache squat", squat)
    assert squat["planted"]["planted"] == f"/tmp/torchinductor_{a}/precompiled_headers/" + os.path.basename(
        before["compile"]["planted"]["planted"]
    )  # B planted the same header as before, in B's own /tmp
    assert _engines_planted(squat["compiled"]) == [False, False] and squat["b_got"] == {}
    home = students.home(a)
    for where in [squat["compiled"]["kernel"], *squat["compiled"]["engines"]]:  # the spawner's env reaches them all
        assert all(
            where[k].startswith(f"{home}/.cache/") for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
        )
        assert where["headers"] == f"{home}/.cache/tmp/torchinductor_{a}/precompiled_headers"
    assert _engines_planted(before["compile"]["compiled"]) == [True, True]


def test_b_sees_nothing_of_a_forges_no_engine_and_reaches_no_host_service(classroom, before, students):
    space = classroom["attacks"]["space"]
    dump("after (ClassroomSpawner): /proc, census, host service, cores", space)
    read = space["snooped"]["read"]
    assert len(read) == 2 * 3 and set(read.values()) == {"FileNotFoundError"}  # A's kernel and engines: not there
    assert space["snooped"]["others_visible"] == 0 and before["space"]["snooped"]["others_visible"] > 0
    assert not space["tag_seen"]  # B cannot read A's watchdog's command line; the test handed the tag over
    assert space["forged"] in space["by_tag_alone"]  # B's process carries A's tag, as before
    (row,) = space["a_row"]
    assert row["engines"] == 2 and str(space["forged"]) not in row["engine pids"].split()
    service_v4, service_v6, hub_api = (f"{h}:{p}" for h, p in space["targets"])
    assert space["reached"][hub_api] == "connected, said nothing"  # B's link reaches the host: the hub's API
    assert not space["reached"][service_v4].startswith("connected")  # and nothing else there, IPv4
    assert not space["reached"][service_v6].startswith("connected")  # nor IPv6 link-local
    assert space["service_served"] == [] and len(before["space"]["service_served"]) == 2
    slot_core = sorted(os.sched_getaffinity(0))[(classroom["slot_b"] - 1) % os.cpu_count()]
    assert space["cores"] == [slot_core] and len(before["space"]["cores"]) > 1  # the cpuset holds B to its core
    limits = []
    for d in space["b_cgroups"]:
        for name in ("memory.max", "memory.limit_in_bytes"):
            if os.path.exists(f"{d}/{name}"):
                limits.append(int(open(f"{d}/{name}").read()))
    assert limits == [4 * 2**30]  # the config's mem_limit, on B's kernel's cgroup


def test_a_stop_leaves_nothing_of_a_student_who_means_to_stay(classroom, before, students):
    hub, b = classroom["hub"], students.names[1]
    stay = stay_and_stop(hub, students, classroom["kernels"][1])
    dump("after (ClassroomSpawner): B's stop", stay)
    seen = stay["before"]
    assert len(seen["cgroups"]) >= 1 and seen["shm"] == [stay["left"]["shm"]]  # B's segment, in B's IPC namespace
    assert seen["namespaces"]["mnt"] != os.stat("/proc/self/ns/mnt").st_ino  # B's own mount, IPC and network
    assert seen["namespaces"]["ipc"] != os.stat("/proc/self/ns/ipc").st_ino
    assert {f"{d}/lk-stay-{students.tag}" for d in ("/tmp", "/var/tmp", "/dev/shm")} <= set(seen["files"])
    assert stay["after"] == {
        "processes": [],
        "namespace_holders": [],
        "cgroups": [],
        "shm": [],
        "files": [],
        "tmpdir": [],
    }
    slot = classroom["slot_b"]
    assert f"labkit-{b}" not in os.listdir(f"/proc/{hub.proc.pid}/root/run/netns") and not _has_link(
        f"{classroom['veth']}{slot}h"
    )
    nft = subprocess.run(["nft", "list", "table", "inet", f"labkit_{classroom['veth']}{slot}"], capture_output=True)
    assert nft.returncode != 0  # B's firewall went with B's link
    assert before["stay"]["after"]["processes"]  # the plain spawner's stop left B's process running
