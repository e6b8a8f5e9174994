"""lab.torchrun: a user's training script, unmodified, under torchrun's contract on the Lab's engines,
measured as labkit measures its own runs and diagnosed as its runs are.

    res = lab.torchrun("train.py", "--steps", "3")              # torchrun --nproc-per-node 4 train.py --steps 3
    res = lab.torchrun("pkg.train", module=True, cwd="/src", env={"HF_HUB_OFFLINE": "1"})
    res.comm_table(); res.memory_table(); figures.timeline_figure(res); res.stdout[1]

One call, on the Lab side (this module; each step bounded):
  1. the door: the script exists here (a module's package is found), the arguments are strings, env=
     does not set a variable torchrun owns, a GPU Lab gives each rank a GPU of its own (else the script's
     `cuda:LOCAL_RANK` would not be its engine's): a ConfigError before any engine work;
  2. the engines repaired if a fault left them so, then rank 0's engine opens the script world's
     store (the agent's store, as torchrun's: engines/script/agent.py `open_store`);
  3. one job on every rank (the job runner, labkit/cluster/jobs.py): each engine starts the script's
     process with its torchrun variables (contract.py) and watches it; lines and steps come back as
     progress (echo.py); a hang is a CollectiveTimeout with the diagnosis of the script's own
     collectives, Ctrl-C and Lab.cancel stop every rank, a rank whose script fails makes the Lab stop
     the others (labkit/cluster/faults.py stop_group) and raise ScriptFailed with torchrun's summary (summary.py);
  4. at the end, whatever the end, every rank's leftovers killed and the store closed (`end_call`).
Returns a ScriptResult (labkit/results/script.py). Why a child process per rank, why the agent's store,
and what each variable is: engines/script/agent.py, contract.py, ARCHITECTURE.md "Where each concept lives".
"""

from __future__ import annotations

import importlib.machinery
import os
import shlex
import sys
import time

from labkit.cluster.arguments import timeout_problems
from labkit.cluster.engine_set import START_TIMEOUT_S, EngineGone
from labkit.cluster.errors import RankError, ScriptFailed
from labkit.cluster.script.contract import env_problems, rank_envs
from labkit.cluster.script.echo import ScriptProgress
from labkit.cluster.script.summary import summary
from labkit.config import ConfigError
from labkit.engines import runtime
from labkit.engines.script import agent
from labkit.results.script import ScriptResult

RANK_JOB = "labkit.engines.script.agent:run_rank"
"""Named, not imported here: the kernel never loads torch."""
STORE_MARGIN_S = 60.0
"""The store's own timeout past the call's: it must outlive every wait a script makes on it."""


def torchrun(
    lab, target, args, *, module=False, cwd=None, env=None, timeout=None, echo=True, source=None, progress=None
):
    """Lab.torchrun's body (its docstring says what each argument is)."""
    if cwd is not None and not isinstance(cwd, (str, os.PathLike)):
        raise ConfigError([f"cwd={cwd!r}: pass the folder the script runs in, a path (or None: the notebook's)"])
    cwd = os.path.abspath(cwd or os.getcwd())
    args = [str(a) if isinstance(a, (int, float, os.PathLike)) and not isinstance(a, bool) else a for a in args]
    bad = door_problems(lab, target, args, module=module, cwd=cwd, env=env, echo=echo, source=source)
    bad += timeout_problems(timeout)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        bad.append(f"progress={progress!r} must be True, False, None or a function of one record")
    if bad:
        raise ConfigError(bad)
    engines, runner = lab.engines, lab._runner
    timeout = lab.timeout if timeout is None else float(timeout)
    name = os.path.basename(target) if not module else target
    shown = ScriptProgress(lab.world, echo=echo, progress=lab.progress if progress is None else progress, label=name)
    ok = False
    with engines.lock:
        runner.repair_if_needed()
        t0 = time.perf_counter()
        try:
            gpus = _gpus(lab)
            port = engines.each(agent.open_store, [0], engines.addr, lab.world, timeout + STORE_MARGIN_S)[0]
            spec = {
                "target": target,
                "module": bool(module),
                "args": args,
                "cwd": cwd,
                "source": source,
                "env": dict(env or {}),
                "envs": rank_envs(
                    engines.hosts, engines.addr, port, launch_env={**os.environ, **(env or {})}, gpus=gpus
                ),
            }
            try:
                reports = runner.run(runtime.call_named, (RANK_JOB, spec), {}, timeout, shown, engine_groups=False)
            except RankError as e:
                raise _failed(lab, name, e, wall=time.perf_counter() - t0) from None
            ok = True
        finally:
            _end(engines)
            shown.close(ok)
    return ScriptResult.from_reports(reports, time.perf_counter() - t0, command(lab, target, args, module=module))


def door_problems(lab, target, args, *, module, cwd, env, echo, source) -> list[str]:
    """Each thing wrong with a call, with its fix, before any engine work."""
    bad = []
    if not isinstance(target, str) or not target:
        return [f"script={target!r}: pass the script's path (or, with module=True, a module's dotted name)"]
    if not os.path.isdir(cwd):
        bad.append(f"cwd={cwd!r} is not a directory; pass the folder the script runs in (torchrun's working directory)")
    elif module:
        top = target.split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, [cwd, *sys.path]) is None:
            bad.append(f"module {target!r}: no package {top!r} in {cwd} or on sys.path; check the name, or pass cwd=")
    elif source is None and not os.path.isfile(os.path.join(cwd, target)):
        bad.append(f"{target} does not exist in {cwd}: pass the script's path (relative to cwd=, or absolute)")
    wrong = [a for a in args if not isinstance(a, str)]
    if wrong:
        bad.append(f"arguments {wrong!r} are not strings: the script's argv is words, e.g. '--steps', '3'")
    bad += env_problems(env)
    if not isinstance(module, bool):
        bad.append(f"module={module!r}: True runs the script as `python -m {target}`, False as `python {target}`")
    if not (isinstance(echo, bool) or (isinstance(echo, (list, tuple, range)) and set(echo) <= set(range(lab.world)))):
        bad.append(f"echo={echo!r}: True (every rank's output), False, or a list of ranks in range({lab.world})")
    cuda = [d for d in lab.devices if d.startswith("cuda")]
    if cuda and len(cuda) < lab.world:
        bad.append(
            "some ranks of this Lab are on a GPU and some are not: torchrun's workers are alike; "
            "use device='cpu', or a GPU each"
        )
    return bad


def _gpus(lab) -> list[str | None] | None:
    """Each rank's GPU on a GPU Lab (none shared on a host: LOCAL_RANK must name each rank's own), else None."""
    if not lab.devices[0].startswith("cuda"):
        return None
    got = lab.engines.each(agent.gpu_id, range(lab.world))
    ids = [got[r] for r in range(lab.world)]
    shared = {(h, g) for h, g in zip(lab.hosts, ids) if sum(1 for x in zip(lab.hosts, ids) if x == (h, g)) > 1}
    if shared:
        raise ConfigError(
            [
                f"ranks share a GPU on {sorted({h for h, _ in shared})}: torchrun gives each worker a GPU of its own "
                "(cuda:LOCAL_RANK); start the Lab with one GPU per rank (gpus=, ranks_per_gpu=1) or device='cpu'"
            ]
        )
    return ids


def _failed(lab, name: str, err: RankError, *, wall: float) -> ScriptFailed:
    """The ScriptFailed of a RankError from stop_group: every rank's report fetched (bounded)."""
    engines = lab.engines
    try:
        got = engines.each(agent.report, engines.live(), bound=START_TIMEOUT_S)
    except EngineGone:
        got = {}
    reports = {r: got.get(r) for r in range(lab.world)}
    text, first = summary(name, reports, failures=err.failures, stopped=err.released)
    result = None
    if all(reports.values()):
        result = ScriptResult.from_reports([reports[r] for r in range(lab.world)], wall, name)
    return ScriptFailed(text, failures=err.failures, released=err.released, rank=first, result=result)


def _end(engines) -> None:
    """Every live rank's script gone and the store closed, whatever ended the call (bounded, best effort:
    an engine that does not answer is replaced at the next call, and its script dies with it)."""
    try:
        engines.each(agent.end_call, engines.live(), bound=10.0)
    except EngineGone as gone:
        engines.condemn(gone.ranks, gone.detail)


def command(lab, target: str, args: list[str], *, module: bool) -> str:
    """The torchrun command line this call stands for."""
    nodes = len(set(lab.hosts))
    per = lab.world // nodes if lab.world % nodes == 0 else "?"
    return shlex.join(
        ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per}", *(["-m"] if module else []), target, *args]
    )
