"""How a Lab gets its engines: started here or found in a running cluster, then joined into one
torch world, with a progress bar while that happens.

A Lab that starts its cluster starts a watchdog first (labkit/cluster/watchdog.py: whatever it
starts ends within seconds if the kernel dies), makes the GPUs it was given visible, and has its
launcher (labkit/cluster/launchers.py) start the controller and the engines (again, on fresh ports,
when the controller lost a port it had picked: `port_taken`); a Lab that connects
reads a running cluster's connection file. Either way every engine then gets a rank and a device
and the torch world is built on them (EngineSet.setup).
"""

from __future__ import annotations

import secrets
import time

import ipyparallel as ipp

from labkit.cluster import gpus, launchers, watchdog
from labkit.cluster import progress as bars
from labkit.cluster.engine_set import START_TIMEOUT_S, EngineSet
from labkit.cluster.errors import LabError

START_ATTEMPTS = 3
"""How many times `start_cluster` starts a cluster whose controller found a port it had picked taken (port_taken)."""
TAKEN = "Address already in use"


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
        cluster, client, retries = start_cluster(launcher, n, token, options, env, registered)
    except BaseException:
        guard.close()
        raise
    started = launchers.Started(launcher, dict(options), retries=retries)
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


def start_cluster(launcher: str, n: int, token: str, options: dict, env: dict | None = None, registered=None):
    """Start a cluster of n engines with `launcher`: (cluster, client, retries), every engine
    registered; retries: for each start tried again, the line that said which port was taken
    (port_taken). registered(k) is called as the count of registered engines grows (the Lab's
    progress bar; ipyparallel's own bar stays off, so a notebook shows one)."""
    retries = []
    while True:
        kwargs, _ = launchers.cluster_settings(launcher, n, token, options, env)
        cluster = ipp.Cluster(**kwargs)
        # ipyparallel writes a batch script into its work_dir, the notebook's cwd: keep it with the
        # cluster's other files (profile_dir, known only now), and never in the user's folder
        cluster.config.BatchSystemLauncher.batch_file_name = launchers.batch_file(cluster)  # the Cluster holds a copy
        failed = None
        try:
            client = cluster.start_and_connect_sync(activate=False)
            wait_for(client, n, registered)
        except Exception as e:
            failed = e
        except BaseException:
            launchers.stop(cluster)
            raise
        # a start that raised, or one that came up with a scheduler that never bound (its messages
        # would never arrive): both say so in the controller's output
        taken = port_taken(cluster)
        if failed is None and not taken:
            return cluster, client, retries
        exited = isinstance(failed, ipp.error.EngineError)
        said = engines_said(cluster) if exited else ""  # read before the stop removes them
        if failed is None:
            client.close()
        launchers.stop(cluster)
        if taken and len(retries) + 1 < START_ATTEMPTS:
            retries.append(taken)
            continue
        if not (taken or exited):
            raise failed
        what = "the engines exited while the Lab started" if exited else "the Lab's cluster did not start"
        raise LabError(f"{what}{f' ({failed})' if failed is not None else ''}{port_lost(taken)}{said}") from None


def port_lost(taken: str) -> str:
    """What a LabError adds when the controller lost a port on every start ('' if it did not)."""
    if not taken:
        return ""
    return f"\n--- the controller, on each of {START_ATTEMPTS} starts, lost a port it had picked ---\n{taken}"


def port_taken(cluster) -> str:
    """The line of the controller's output that says a port it had picked was taken, else ''.

    ipyparallel picks the controller's ~18 TCP ports by binding port 0 and closing the socket, and
    binds them for real later: its schedulers in threads, its heart monitor in a process forked
    after them, a second or more later on a loaded machine. A port the kernel handed to another
    process meanwhile (gloo's listeners and connections, another Lab's own picks: the same range)
    fails that bind. A heart monitor that cannot bind pings no engine, and every engine exits
    launchers.HEARTBEAT_MISSES later (seen in CI, two test workers side by side); a scheduler that cannot bind
    never delivers its messages. The race is ipyparallel's (its ipc transport, which has no ports,
    names endpoints one way in the controller and another in the engines and clients: unusable in
    9.2), so `start_cluster` starts again on fresh ports; benchmarks/port_race.py counts both."""
    launcher = cluster.controller
    if launcher is None:
        return ""
    try:
        with open(launcher.output_file, errors="replace") as f:
            text = f.read()
    except (AttributeError, OSError):
        # a controller that exited (its hub could not bind) has had its file read and removed by
        # ipyparallel, which keeps the text; asked while the file is there, it would keep a stale one
        text = launcher.get_output() or ""
    return next((line.strip() for line in text.splitlines() if TAKEN in line), "")


def engines_said(cluster, lines: int = 8) -> str:
    """What the exited engines wrote last (their logs, warnings and errors, and their stderr): the
    first one's last `lines` lines, the others' last line each. ipyparallel's own error carries only the
    exit codes, and its launcher deletes the engines' log files."""
    for engine_set in cluster.engines.values():
        engine_set.get_output()  # fills `outputs` with what the engines still running wrote too
    said = [
        (engine, text.rstrip().splitlines())
        for engine_set in cluster.engines.values()
        for engine, text in sorted(getattr(engine_set, "outputs", {}).items())
        if text.strip()
    ]
    if not said:
        return "\n(the engines wrote nothing: see the launcher's own log)"
    (first, text), others = said[0], said[1:]
    out = [f"\n--- engine {first}, the last lines it wrote ---", *text[-lines:]]
    out += [f"--- engine {engine}, its last line ---\n{text[-1]}" for engine, text in others]
    return "\n".join(out)


def wait_for(client, n: int, registered=None) -> None:
    """Until n engines have registered, telling registered(k) as k grows; TimeoutError past
    START_TIMEOUT_S."""
    deadline, seen = time.monotonic() + START_TIMEOUT_S, -1
    while len(client.ids) < n:
        # told only when the count changes: one update of the bar per engine, not per poll
        if len(client.ids) != seen and registered is not None:
            seen = len(client.ids)
            registered(seen)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n - len(client.ids)} of {n} engines did not register within {START_TIMEOUT_S:g} s")
        time.sleep(0.05)
    if registered is not None:
        registered(n)
