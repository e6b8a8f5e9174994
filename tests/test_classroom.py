"""The classroom's rules without a hub (the hub itself: tests/test_classroom_hub.py): how the spawner
hands out cores, GPUs and links by slot, where it puts each student's cgroups, what the firewall on a
student's link lets through, what it refuses and how it says so, and that the deployment's config
loads as JupyterHub reads it (and refuses a state directory other users can enter)."""

from __future__ import annotations

import os
import sys

import pytest
from hub_tools import CLASSROOM

try:
    import jupyterhub  # noqa: F401  (the spawner subclasses its LocalProcessSpawner)
except ImportError:
    if os.environ.get("LABKIT_REQUIRE_CLUSTER_TOOLS"):
        raise
    pytest.skip("the classroom needs jupyterhub (pip install jupyterhub==6.1.1)", allow_module_level=True)
sys.path.insert(0, str(CLASSROOM))
from classroom_spawner import ClassroomSpawner, link, share_out  # noqa: E402
from student_cgroup import StudentCgroup  # noqa: E402
from student_net import rules  # noqa: E402
from student_space import directories  # noqa: E402


def test_cores_and_gpus_go_round_robin_by_slot():
    cores = list(range(8))
    assert [share_out(cores, 3, slot) for slot in (1, 2, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 0]]
    assert share_out(["GPU-a", "GPU-b"], 1, 3) == ["GPU-a"]  # more students than GPUs: they share
    assert share_out(cores, 0, 5) == [] and share_out([], 1, 1) == []  # 0: not pinned; no GPUs: none
    with pytest.raises(ValueError, match="3 per student, and the machine has 2: ask for at most 2"):
        share_out(["GPU-a", "GPU-b"], 3, 1)


def test_each_student_gets_a_link_of_their_own_and_a_wrong_network_is_named():
    assert link("10.44.0.0/16", 1) == ("10.44.0.5", "10.44.0.6", "30")
    assert link("10.44.0.0/16", 2) == ("10.44.0.9", "10.44.0.10", "30")
    ends = {end for slot in range(1, 64) for end in link("10.44.7.0/24", slot)[:2]}
    assert len(ends) == 2 * 63  # no two students share an address
    with pytest.raises(ValueError, match="room for 63 students"):
        link("10.44.7.0/24", 64)
    with pytest.raises(ValueError, match="IPv4 network of /28 or wider"):
        link("fd00::/64", 1)


def test_the_deployment_config_loads_with_the_classroom_spawner_and_the_culler(tmp_path, monkeypatch):
    from traitlets.config.loader import PyFileConfigLoader

    state = tmp_path / "hub"
    state.mkdir(mode=0o755)
    monkeypatch.chdir(state)  # the hub's state directory is the one it starts in
    with pytest.raises(SystemExit, match=r"hub's state directory .*hub is open to other users \(mode 755\)"):
        PyFileConfigLoader("jupyterhub_config.py", path=str(CLASSROOM)).load_config()
    state.chmod(0o700)
    config = PyFileConfigLoader("jupyterhub_config.py", path=str(CLASSROOM)).load_config()
    assert config.JupyterHub.spawner_class is ClassroomSpawner
    assert config.JupyterHub.hub_bind_url.startswith("http://0.0.0.0:")  # the students' links reach it
    (culler,) = config.JupyterHub.services
    assert "jupyterhub_idle_culler" in culler["command"] and "--timeout=3600" in culler["command"]
    (role,) = config.JupyterHub.load_roles
    assert role["services"] == ["idle-culler"] and "delete:servers" in role["scopes"]
    assert config.Spawner.mem_limit == "4G"  # enforced by each student's cgroup


def _hierarchy(root, controllers: str = ""):
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    return str(root)


def test_a_students_cgroups_go_beside_the_hubs_in_v2_and_below_it_in_v1(tmp_path):
    # cgroup v2 alone (current distributions, the hub a systemd service): one cgroup with every
    # controller, beside the hub's (v2 gives controllers only to children of a cgroup without processes)
    v2 = _hierarchy(tmp_path / "v2", "cpuset cpu io memory pids")
    own = {"v2": "/system.slice/jupyterhub.service"}
    pure = StudentCgroup("alice", cores=[3], memory=2**30, mounts={"v2": v2}, own=own)
    assert set(pure.dirs.values()) == {f"{v2}/system.slice/labkit-classroom/alice"}
    assert set(pure.dirs) == {"kill", "cpuset", "memory"}
    # hybrid (this test machine's kind): the kill in the unified hierarchy, the limits in v1's,
    # each below the hub's own cgroup there
    unified = _hierarchy(tmp_path / "unified", "hugetlb")
    mounts = {"v2": unified, "cpuset": str(tmp_path / "cpuset"), "memory": str(tmp_path / "memory")}
    own = {"v2": "/", "cpuset": "/", "memory": "/hub/a1"}
    hybrid = StudentCgroup("alice", cores=[0], memory=2**30, mounts=mounts, own=own)
    assert hybrid.dirs == {
        "kill": f"{unified}/labkit-classroom/alice",
        "cpuset": f"{tmp_path}/cpuset/labkit-classroom/alice",
        "memory": f"{tmp_path}/memory/hub/a1/labkit-classroom/alice",
    }
    # neither cores nor memory asked for: the cgroup is there to end the server whole
    assert set(StudentCgroup("bob", cores=[], memory=None, mounts=mounts, own=own).dirs) == {"kill"}
    with pytest.raises(RuntimeError, match="needs the memory cgroup controller.*mem_limit = None"):
        StudentCgroup("alice", cores=[], memory=2**30, mounts={"v2": unified}, own=own)
    with pytest.raises(ValueError, match="a user name, without '/'"):
        StudentCgroup("../hub", cores=[], memory=None, mounts=mounts, own=own)


def test_a_students_link_lets_through_the_hubs_port_and_replies_only():
    text = rules("lkc", 3, "10.44.0.13", 8081)
    assert "table inet labkit_lkc3" in text  # inet: IPv4 and IPv6 alike
    accepts = [line.strip() for line in text.splitlines() if line.strip().endswith("accept")]
    assert accepts == [
        'iifname "lkc3h" ct state established,related accept',
        'iifname "lkc3h" ip daddr 10.44.0.13 tcp dport 8081 ct state new accept',
    ]
    assert 'iifname "lkc3h" drop' in text and 'oifname "lkc3h" drop' in text


def test_a_students_temporary_files_and_compile_caches_are_in_their_home():
    assert directories("/home/alice") == {
        "TMPDIR": "/home/alice/.cache/tmp",
        "TORCHINDUCTOR_CACHE_DIR": "/home/alice/.cache/torchinductor",
        "TRITON_CACHE_DIR": "/home/alice/.cache/triton",
    }
