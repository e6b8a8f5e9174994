"""The Lab: an ipyparallel cluster whose engines are the ranks of one torch.distributed world.

    with Lab(engines=4) as lab:                 # local cluster, 127.0.0.1 only
        res = lab.run(ParallelConfig(dp=4), model=ModelConfig(), steps=3)

    lab = Lab.connect(profile="slurm")          # a cluster started elsewhere (ipcluster)

Every call runs in a job thread on the engines (labkit.engines.runtime) and the Lab polls
them: progress shows per step, a run that stops making progress becomes a CollectiveTimeout
with the ranks' collective logs analysed, an exception on one rank comes back with its rank
and traceback, and in every such case the Lab restarts what is stuck and rebuilds the process
group, so the next run works in the same kernel.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections import Counter

from labkit.config import ModelConfig, OptimConfig, ParallelConfig, validate
from labkit.diagnose import analyse
from labkit.engines import runtime
from labkit.errors import Cancelled, CollectiveTimeout, EngineDied, LabError, RankError
from labkit.results import RunResult

POLL_S = 0.05
START_TIMEOUT_S = 120.0


def _print_progress(p: dict) -> None:
    print(f"step {p['step'] + 1}/{p['steps']}  loss {p['loss']:.4f}  ({p['seconds']:.2f} s)", flush=True)


def _by_value(fn) -> bytes:
    """Pickle fn so an engine can run it: by value when its module is not an installed package."""
    import cloudpickle

    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(mod, "__file__", None) or ""
    installed = "site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)
    if mod is not None and mod.__name__ != "__main__" and not installed and not mod.__name__.startswith("labkit"):
        cloudpickle.register_pickle_by_value(mod)
    return cloudpickle.dumps(fn)


class _StepProgress:
    """Combines the ranks' per-step records into one: {step, steps, loss (global), seconds}.

    Records that are not training steps (a user's apply may report anything) pass through."""

    def __init__(self, show):
        self.show = show
        self.pending: dict[int, list[dict]] = {}

    def add(self, rec: dict) -> None:
        if "loss_share" not in rec:
            if rec.get("rank", 0) == 0:
                self.show(rec)
            return
        got = self.pending.setdefault(rec["step"], [])
        got.append(rec)
        if len(got) == rec["ranks"]:
            del self.pending[rec["step"]]
            self.show({"step": rec["step"], "steps": rec["steps"],
                       "loss": sum(r["loss_share"] for r in got) / rec["shards"],
                       "seconds": max(r["seconds"] for r in got)})


class Lab:
    """A local ipyparallel cluster (or a connection to one) ready to run parallel layouts.

    engines: how many engines (ranks) to start locally.
    backend: 'auto' (nccl when every engine has its own GPU, else gloo), 'gloo' or 'nccl'.
    timeout: seconds a run or apply may take before it is diagnosed as a hang (the process
             groups are created with the same timeout).
    progress: print one line per step (True), stay quiet (False), or call progress(record).
    """

    def __init__(self, engines: int = 4, backend: str = "auto", timeout: float = 300.0,
                 progress=True, *, _client=None, _cluster=None, master_addr: str | None = None):
        import ipyparallel as ipp

        self.timeout = float(timeout)
        self.backend_choice = backend
        self.progress = progress
        self.master_addr = master_addr
        self._lock = threading.RLock()
        self._generation = 0
        self.cluster = _cluster
        if _client is None:
            if engines < 1:
                raise LabError(f"engines={engines}: a Lab needs at least one engine")
            self.cluster = ipp.Cluster(n=engines, controller_ip="127.0.0.1", engine_timeout=60,
                                       log_level=40)
            self.local = True
            try:
                self.client = self.cluster.start_and_connect_sync(activate=False)
                self.client.wait_for_engines(engines, timeout=START_TIMEOUT_S)
            except BaseException:
                self._stop_cluster()
                raise
            self._n = engines
        else:
            self.client = _client
            self.local = False
            self._n = len(_client.ids)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(cls, profile: str | None = None, url_file: str | None = None, cluster_id: str = "",
                engines: int | None = None, backend: str = "auto", timeout: float = 300.0,
                progress=True, master_addr: str | None = None, **client_kwargs) -> "Lab":
        """Attach to a running ipyparallel cluster (`ipcluster start` with any launcher).

        The connection uses the cluster's connection file (ipcontroller-client.json), which
        carries its authentication key: no unauthenticated port is ever used. `engines` waits
        for that many engines first. The rendezvous listens on rank 0's address (override
        with master_addr when that host has several).
        """
        import ipyparallel as ipp

        kwargs = dict(client_kwargs)
        args = (url_file,) if url_file else ()   # ipyparallel 9 reads the file as connection_info
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
        return cls(backend=backend, timeout=timeout, progress=progress, _client=client, master_addr=master_addr)

    # -- set-up -----------------------------------------------------------------------------
    def _setup(self) -> None:
        """Give each engine a rank and a device and build the torch.distributed world."""
        retired = getattr(self, "_retired", set())
        self.ids = sorted(e for e in self.client.ids if e not in retired)
        if self.local:
            self.ids = self.ids[: self._n]
        self.world = len(self.ids)
        self.view = self.client[self.ids]
        infos = self.view.apply_sync(runtime.engine_info)
        self.hosts = [i["host"] for i in infos]
        per_host = Counter(self.hosts)
        local_index, seen = [], Counter()
        for h in self.hosts:
            local_index.append(seen[h])
            seen[h] += 1
        own_gpu = all(i["gpus"] >= per_host[h] for i, h in zip(infos, self.hosts))
        if self.backend_choice == "auto":
            self.backend = "nccl" if own_gpu and infos[0]["gpus"] > 0 else "gloo"
        else:
            self.backend = self.backend_choice
        if self.backend == "nccl" and not own_gpu:
            raise LabError(f"backend='nccl' needs one GPU per engine; hosts have {[i['gpus'] for i in infos]} GPUs "
                           f"for {dict(per_host)} engines. Use backend='gloo' to share GPUs or run on CPU")
        use_gpu = self.backend == "nccl"
        self.devices = [f"cuda:{k % max(1, i['gpus'])}" if use_gpu else "cpu" for k, i in zip(local_index, infos)]
        loopback = self.local and len(per_host) == 1
        addr = self.master_addr or ("127.0.0.1" if loopback else infos[0]["addr"])
        threads = [max(1, (os.cpu_count() or 1) // per_host[h]) for h in self.hosts]
        self._rendezvous(addr, threads, loopback)

    def _rendezvous(self, addr: str, threads: list[int], loopback: bool) -> None:
        self._generation += 1
        port = self.client[self.ids[0]].apply_sync(runtime.open_rendezvous, addr)
        pending = [self.client[eid].apply_async(
            runtime.init_distributed, rank, self.world, addr, port, self.backend, self.devices[rank],
            self.timeout, self._generation, threads[rank], loopback) for rank, eid in enumerate(self.ids)]
        deadline = time.monotonic() + START_TIMEOUT_S
        self.runtimes = [p.get(timeout=max(1.0, deadline - time.monotonic())) for p in pending]

    # -- running ----------------------------------------------------------------------------
    def apply(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank, with the process group ready; results in rank order.

        fn may come from a notebook, a script or a test module the engines cannot import: it
        is shipped by value (cloudpickle) unless it lives in an installed package."""
        return self._execute(runtime.call_pickled, (_by_value(fn), *args), kwargs, timeout, None)

    def run(self, cfg: ParallelConfig | None = None, model: ModelConfig | None = None, steps: int = 3,
            seed: int = 0, optim: OptimConfig | None = None, timeout: float | None = None,
            progress=None, return_params: bool = False, audit: bool = False) -> RunResult:
        """Train `steps` steps of `model` laid out as `cfg` on the engines; returns a RunResult.

        Raises ConfigError (before any engine work) for a layout that cannot run here.
        return_params brings back the final full parameters (res.params) for checking;
        audit runs a TorchDispatchMode beside the comm meter (slow; tests use it).
        """
        cfg = cfg or ParallelConfig()
        model = model or ModelConfig()
        optim = optim or OptimConfig()
        if not isinstance(steps, int) or steps < 1:
            from labkit.config import ConfigError
            raise ConfigError([f"steps={steps!r} must be a positive integer"])
        validate(cfg, model, self.world)
        from labkit.engines.mesh import MeshLayout   # a TP group across hosts: say so (mesh.py AXIS_WARNINGS)
        for w in MeshLayout.of(cfg).warnings(self.hosts[:cfg.world]):
            warnings.warn(w, stacklevel=2)
        from labkit.engines.train import run_rank

        spec = {"parallel": cfg.to_dict(), "model": model.to_dict(), "optim": optim.to_dict(),
                "steps": steps, "seed": seed, "return_params": return_params, "audit": audit}
        t0 = time.perf_counter()
        reports = self._execute(run_rank, (spec,), {}, timeout, progress if progress is not None else self.progress)
        return RunResult.from_reports(cfg, model, optim, steps, seed, reports, time.perf_counter() - t0)

    def cancel(self) -> None:
        """Ask the job on every engine to stop at its next step or microbatch boundary."""
        self.view.apply_sync(runtime.cancel)

    def _execute(self, fn, args: tuple, kwargs: dict, timeout: float | None, progress) -> list:
        import ipyparallel as ipp

        timeout = self.timeout if timeout is None else float(timeout)
        show = _print_progress if progress is True else (progress or None)
        steps = _StepProgress(show) if show else None
        with self._lock:
            try:
                self.view.apply_sync(runtime.start, fn, *args, **kwargs)
                seen = [0] * self.world
                deadline = time.monotonic() + timeout
                while True:
                    polls = [self.client[eid].apply_async(runtime.poll, seen[r]) for r, eid in enumerate(self.ids)]
                    states = []
                    for r, p in enumerate(polls):
                        out = p.get(timeout=30)
                        seen[r] += len(out["progress"])
                        if steps is not None:
                            for rec in out["progress"]:
                                steps.add(rec)
                        states.append(out)
                    kinds = {s["state"] for s in states}
                    if kinds == {"done"}:
                        return self.view.apply_sync(runtime.result)
                    if "error" in kinds:
                        self._fail(states)
                    if "cancelled" in kinds and "running" not in kinds:
                        raise Cancelled("the run was cancelled on the engines")
                    if time.monotonic() > deadline:
                        self._timeout(timeout)
                    time.sleep(POLL_S)
            except KeyboardInterrupt:
                self._recover_after(lambda: self.view.apply_sync(runtime.cancel))
                raise
            except ipp.error.EngineError as e:
                self._engine_died(e)

    # -- faults -----------------------------------------------------------------------------
    def _fail(self, states: list[dict]) -> None:
        """An exception on some rank: give the others a moment to fail or finish, then release
        whoever is stuck waiting for the failed rank, and raise its traceback."""
        deadline = time.monotonic() + 2.0
        while any(s["state"] == "running" for s in states) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            states = self.view.apply_sync(runtime.poll, 10**9)
        failures = {r: {"host": self.hosts[r], "traceback": s["error"]}
                    for r, s in enumerate(states) if s["state"] == "error"}
        self.restart()
        raise RankError(failures)

    def _timeout(self, timeout: float) -> None:
        polls = self.view.apply_sync(runtime.poll, 10**9, 400)
        logs = {r: p.get("log", []) for r, p in enumerate(polls)}
        found = analyse(logs, dict(enumerate(self.hosts)))
        self.restart()
        raise CollectiveTimeout(timeout, found["text"], found)

    def _engine_died(self, err) -> None:
        alive = set(self.client.ids)
        dead = [r for r, eid in enumerate(self.ids) if eid not in alive] or [0]
        self.restart()
        raise EngineDied(dead[0], self.hosts[dead[0]], str(err).splitlines()[0] if str(err) else "")

    def _recover_after(self, action) -> None:
        try:
            action()
            time.sleep(0.5)
            states = self.view.apply_sync(runtime.poll, 10**9)
            if any(s["state"] == "running" for s in states):
                self.restart()
        except Exception:
            self.restart()

    def restart(self) -> None:
        """Restart every engine and rebuild the process group (after a hang or a fault).

        A rank stuck inside a collective cannot be interrupted from Python, so the engines are
        replaced; on a connected (remote) cluster they are asked to restart through ipcluster.
        """
        if self.cluster is not None:
            self.cluster.stop_engines_sync()
            self.cluster.start_engines_sync(n=self._n)
            self._wait_for_new_engines()
        else:
            raise LabError("this Lab is connected to a cluster it did not start; restart its engines "
                           "with ipcluster and call Lab.connect again")
        self._setup()

    def _wait_for_new_engines(self) -> None:
        old = set(getattr(self, "ids", []))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            fresh = [e for e in self.client.ids if e not in old]
            if len(fresh) >= self._n:
                self._retired = old
                return
            time.sleep(0.1)
        raise LabError(f"restarted engines did not register within {START_TIMEOUT_S:g} s")

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engines and controller this Lab started (or disconnect from a shared cluster)."""
        try:
            if getattr(self, "view", None) is not None and not self.local:
                self.view.apply_sync(runtime.shutdown_distributed)
        except Exception:
            pass
        try:
            self.client.close()
        except Exception:
            pass
        self._stop_cluster()

    def _stop_cluster(self) -> None:
        if self.local and self.cluster is not None:
            try:
                self.cluster.stop_cluster_sync()
            except Exception:
                pass
            self.cluster = None

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lab(engines={self.world}, backend={self.backend!r}, hosts={sorted(set(self.hosts))})"
