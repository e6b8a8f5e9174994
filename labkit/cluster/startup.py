"""How a Lab gets its engines: started here or found in a running cluster, then joined into one
torch world, with a progress bar while that happens.

A Lab that starts its cluster starts a watchdog first (labkit/cluster/watchdog.py: whatever it
starts ends within seconds if the kernel dies), makes the GPUs it was given visible, and has its
launcher (labkit/cluster/launchers.py) start the controller and the engines; a Lab that connects
reads a running cluster's connection file. Either way every engine then gets a rank and a device
and the torch world is built on them (EngineSet.setup).
"""

from __future__ import annotations

import secrets

import ipyparallel as ipp

from labkit.cluster import gpus, launchers, watchdog
from labkit.cluster import progress as bars
from labkit.cluster.engine_set import START_TIMEOUT_S, EngineSet
from labkit.cluster.errors import LabError


def open_engines(
    n: int, launcher: str, options: dict, gpu: dict, choices: dict, progress, client=None, cluster=None
) -> EngineSet:
    """A Lab's engines in one torch world: `n` started by `launcher` (with its `options` and the
    Lab's `gpu` choices), or those of `client` (a running cluster; `cluster` if the Lab started
    it); choices: the EngineSet's backend, device, timeout and master_addr. `progress` (the Lab's)
    shows each stage. If they cannot join, whatever was started is stopped and the error goes on."""
    shown = bars.bar(progress, n if client is None else len(client.ids), "engines")
    try:
        if client is None:
            registered = (lambda k: shown.update(k, "registered")) if shown else None
            engines = start(n, launcher, options, gpu, choices, registered)
        else:
            engines = EngineSet(client, cluster, local=False, **choices)
    except BaseException:
        if shown:
            shown.close("could not start", ok=False)
        raise
    try:
        if shown:
            shown.update(engines.world, "joining one torch world")
        engines.setup()
    except BaseException:
        if shown:
            shown.close("could not join one torch world", ok=False)
        engines.close(wait=10.0)
        raise
    if shown:
        why = f" ({engines.backend_reason})" * bool(engines.backend_reason)
        shown.close(f"{engines.world} ranks ready: {engines.backend} on {engines.devices[0].split(':')[0]}{why}")
    return engines


def start(n: int, launcher: str, options: dict, gpu: dict, choices: dict, registered=None) -> EngineSet:
    """Start a watchdog, then the cluster (its processes tagged for the watchdog), as an EngineSet.
    gpu: the Lab's gpus, ranks_per_gpu and gpu_memory_fraction; registered(k) is called as the
    count of registered engines grows (the Lab's progress bar)."""
    token = secrets.token_hex(8)
    env = {}
    visible = gpus.visible_devices(gpu["gpus"], n, gpu["ranks_per_gpu"])
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
        if (
            choices["device"] == "auto"
        ):  # GPUs were asked for: ranks on them even when they share one (labkit/cluster/world.py)
            choices = {**choices, "device": "cuda"}
    guard = watchdog.Watchdog(token)
    try:
        cluster, client = launchers.start(launcher, n, token, options, env, registered)
    except BaseException:
        guard.close()
        raise
    started = launchers.Started(launcher, dict(options))
    fraction = gpu["gpu_memory_fraction"]
    engines = EngineSet(
        client, cluster, n, local=True, started=started, watchdog=guard, gpu_memory_fraction=fraction, **choices
    )
    engines.watch_jobs()
    return engines


def connect(profile: str | None, url_file: str | None, cluster_id: str, engines: int | None, **client_kwargs):
    """A client of a running cluster (its connection file carries the authentication key),
    with `engines` registered if given, or at least one."""
    kwargs = dict(client_kwargs)
    args = (url_file,) if url_file else ()  # ipyparallel 9 reads the file as connection_info
    if profile:
        kwargs["profile"] = profile
    if cluster_id:
        kwargs["cluster_id"] = cluster_id
    client = ipp.Client(*args, **kwargs)
    if engines:
        client.wait_for_engines(engines, timeout=START_TIMEOUT_S)
    if not client.ids:
        client.close()
        raise LabError("the cluster has no engines; start some (ipcluster engines ...) or pass engines=N")
    return client
