"""torchrun's contract with a script, as torch 2.13's elastic agent keeps it: the variables each
worker starts with (torch/distributed/elastic/agent/server/local_elastic_agent.py `_start_workers`,
torch/distributed/run.py for OMP_NUM_THREADS), for a Lab's ranks. Pure: plain data in and out.

A Lab's engines play torchrun's nodes: a host is a node (GROUP_RANK, in the order of the ranks, which
go host by host), its ranks are the node's workers (LOCAL_RANK), and rank 0's engine is the agent that
hosts the store (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's static and
c10d rendezvous both say). There is one role ('default') and no restart (a failed call is repaired
by the Lab, never re-run). Compared with a real `torchrun --nproc-per-node 2` dump on this machine
(tests/test_scripts.py): the same names and values, but for MASTER_ADDR (the Lab's rendezvous address
where torchrun's standalone says 'localhost'), MASTER_PORT and TORCHELASTIC_RUN_ID (fresh each run).
TORCHELASTIC_ERROR_FILE is each rank's own path, set by its engine (engines/script/agent.py).
"""

from __future__ import annotations

import uuid

ROLE = "default"
"""torchrun's --role default (its only role here)."""
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""TORCHELASTIC_SIGNALS_TO_HANDLE: torchrun's default (torch/distributed/run.py --signals-to-handle)."""
NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHELASTIC_ERROR_FILE",
)
"""The variables torchrun sets and labkit sets in its place (env= may not override them)."""


def rank_envs(
    hosts: list[str],
    addr: str,
    port: int,
    *,
    launch_env: dict[str, str],
    gpus: list[str | None] | None = None,
    run_id: str | None = None,
) -> list[dict[str, str]]:
    """Each rank's torchrun variables. hosts: each rank's host, ranks host by host; addr, port: the
    script world's store; launch_env: the environment torchrun would have been started in (the
    notebook's, with env= over it); gpus: each rank's GPU ('GPU-<uuid>') on a Lab with one GPU per
    rank, else None. TORCHELASTIC_ERROR_FILE is left to each rank's engine."""
    world = len(hosts)
    nodes = list(dict.fromkeys(hosts))  # hosts in rank order: GROUP_RANK
    run_id = run_id or str(uuid.uuid4())
    out = []
    for rank, host in enumerate(hosts):
        peers = [r for r, h in enumerate(hosts) if h == host]
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(peers.index(rank)),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "GROUP_RANK": str(nodes.index(host)),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": ROLE,
            "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS,
            # the agent's own value, else "1" (torch's default there)
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": launch_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        # torchrun sets 1 thread per worker when a node runs several and the launch set none
        threads = launch_env.get("OMP_NUM_THREADS") or ("1" if len(peers) > 1 else None)
        if threads:
            env["OMP_NUM_THREADS"] = threads
        if gpus and all(gpus):
            # every GPU of the node visible to each worker, in local-rank order, as under torchrun on a node:
            # cuda:LOCAL_RANK is this rank's own GPU, whatever its engine was given
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[r] for r in peers)
        out.append(env)
    return out


def env_problems(env) -> list[str]:
    """What is wrong with a user's env= (each with its fix)."""
    if env is None:
        return []
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return [f"env={env!r} must be a dict of str to str (environment variables for every rank)"]
    taken = sorted(k for k in env if k in NAMES)
    if taken:
        return [f"env sets {taken}: torchrun's contract sets these per rank (labkit does it in its place); drop them"]
    return []
