"""A class on one server: JupyterHub with one Unix user per student, each student's Labs out of the
other students' reach (classroom/README.md says why each line is here, and what a class needs).

    cd /srv/jupyterhub && sudo jupyterhub -f /path/to/labkit/classroom/jupyterhub_config.py

The hub keeps its database (users, each server's state, token hashes) and cookie secret in the
directory it starts in, which must be root's alone (0700): the hub refuses to start in another.
Students log in with their Unix password (PAM) and must be in the group `students`; the teacher is an admin.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # classroom_spawner.py, beside this file

from classroom_spawner import ClassroomSpawner  # noqa: E402

c = get_config()  # noqa: F821  (JupyterHub's config loader provides it)

# -- its state: the database is created 0644, so the directory is what keeps students out of it ----
if os.stat(".").st_mode & 0o077:
    raise SystemExit(
        f"the hub's state directory {os.getcwd()} is open to other users (mode {os.stat('.').st_mode & 0o777:o}): "
        "its database holds every user's server state and token hashes; chmod 700 it, or start the hub in one that is"
    )

# -- who ---------------------------------------------------------------------------------------
c.JupyterHub.authenticator_class = "pam"  # the students' Unix accounts: one Unix user each
c.PAMAuthenticator.allowed_groups = {"students"}
c.Authenticator.admin_users = {"teacher"}  # sees every server; its stop button stops one

# -- where -------------------------------------------------------------------------------------
c.JupyterHub.bind_url = "http://:8000"  # the proxy's public side: put TLS in front (or set ssl_cert)
# The hub's API on every address: each student's server reaches it over its own link
# (classroom_spawner.py); the proxy already publishes the same API at /hub/api.
c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081"
c.JupyterHub.hub_connect_url = "http://127.0.0.1:8081"  # how the proxy and services reach it

# -- each student's server ---------------------------------------------------------------------
c.JupyterHub.spawner_class = ClassroomSpawner  # LocalProcessSpawner + a network namespace per student
c.ClassroomSpawner.cores_per_student = 0  # 0: every core; 30 students on 112 cores: 3 (README.md)
c.ClassroomSpawner.gpus_per_student = 1  # 8 GPUs, 30 students: 3 or 4 students on each
# each student's server, kernels and Labs together, enforced by their cgroup (README.md: notebooks
# 00-07 need ~1.1 GiB, 08 ~1.8 GiB; their own /tmp, /dev/shm count in it too)
c.Spawner.mem_limit = "4G"
# the server runs from the hub's own environment (labkit, jupyterhub, torch): every student must be
# able to read and run it (install it under /opt or /usr/local, not under /root)
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.http_timeout = 120  # a loaded server takes a while to start the first one
c.Spawner.start_timeout = 120

# -- idle culling: a server idle for an hour is stopped (and everything it started ends) -------
c.JupyterHub.services = [
    {"name": "idle-culler", "command": [sys.executable, "-m", "jupyterhub_idle_culler", "--timeout=3600"]}
]
c.JupyterHub.load_roles = [
    {
        "name": "idle-culler",
        "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
        "services": ["idle-culler"],
    }
]
