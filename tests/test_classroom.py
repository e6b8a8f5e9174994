"""The classroom's rules without a hub (the hub itself: tests/test_classroom_hub.py): how the spawner
hands out cores, GPUs and links by slot, what it refuses and how it says so, and that the
deployment's config loads as JupyterHub reads it."""

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


def test_the_deployment_config_loads_with_the_classroom_spawner_and_the_culler():
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("jupyterhub_config.py", path=str(CLASSROOM)).load_config()
    assert config.JupyterHub.spawner_class is ClassroomSpawner
    assert config.JupyterHub.hub_bind_url.startswith("http://0.0.0.0:")  # the students' links reach it
    (culler,) = config.JupyterHub.services
    assert "jupyterhub_idle_culler" in culler["command"] and "--timeout=3600" in culler["command"]
    (role,) = config.JupyterHub.load_roles
    assert role["services"] == ["idle-culler"] and "delete:servers" in role["scopes"]
