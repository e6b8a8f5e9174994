"""The Lab: an ipyparallel cluster whose engines are the ranks of one torch.distributed world.

    with Lab(engines=4) as lab:                 # local cluster, 127.0.0.1 only
        res = lab.run(ParallelConfig(dp=4), model=ModelConfig(), steps=3)

    lab = Lab.connect(profile="slurm")          # a cluster started elsewhere (ipcluster)

Every call runs in a job thread on the engines (labkit.engines.runtime) and the Lab polls
them, so the notebook never waits on anything without a bound:
  - a run that does not finish within its timeout becomes a CollectiveTimeout whose message
    is the diagnosis of the ranks' collective logs (labkit.diagnose);
  - an exception on a rank comes back as a RankError with its rank and traceback, and the
    ranks that were waiting for it in a collective are released (runtime.release);
  - an engine that dies (or stops answering) becomes EngineDied naming its rank and host;
  - Ctrl-C (KeyboardInterrupt) or Lab.cancel() stops the job on the engines too.
Each error is raised as soon as it is known. The repair — replacing dead or stuck engines and
rebuilding the process groups on a fresh port — happens at the start of the next call (faults.py
has the fault handling; this file the set-up and the polling loop).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections import Counter

from labkit.arguments import run_problems, timeout_problems
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunSpec, optim_problems, validate
from labkit.engines import runtime
from labkit.errors import Cancelled, LabError
from labkit.faults import FaultHandling, _Died
from labkit.progress import StepProgress, print_progress
from labkit.results import RunResult

POLL_MIN_S, POLL_MAX_S = 0.02, 0.25
"""The Lab polls the engines at first every 20 ms (short runs return at once), backing off to 4 per second."""
START_TIMEOUT_S = 120.0
"""Bound on starting engines, building the process groups and bringing results back."""
DEFAULT_TIMEOUT_S = 300.0
"""A run or apply that takes longer is diagnosed as a hang. Generous for CPU demos; pass your own."""


def _by_value(fn) -> bytes:
    """Pickle fn so an engine can run it: by value when its module is not an installed package."""
    import cloudpickle

    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(mod, "__file__", None) or ""
    installed = "site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)
    if mod is not None and mod.__name__ != "__main__" and not installed and not mod.__name__.startswith("labkit"):
        cloudpickle.register_pickle_by_value(mod)
    return cloudpickle.dumps(fn)


class Lab(FaultHandling):
    """A local ipyparallel cluster (or a connection to one) ready to run parallel layouts.

    engines: how many engines (ranks) to start locally.
    backend: 'auto' (nccl when every engine has its own GPU, else gloo), 'gloo' or 'nccl'.
    device: 'auto' (a GPU each under nccl, else the CPU), 'cpu', or 'cuda': ranks on the GPUs
            even when several share one — NCCL refuses two ranks on one GPU, so with more engines
            than GPUs 'cuda' runs gloo on CUDA tensors (a classroom on one GPU server).
    timeout: seconds a run or apply may take before it is diagnosed as a hang (default for the
             calls' own `timeout`; each job's process groups time out just after it).
    progress: print one line per step (True), stay quiet (False), or call progress(record).

    Thread-safe: one call runs at a time (others wait, bounded); `cancel()` may come from any
    thread (a widget's button) and stops the call in progress.
    """

    def __init__(self, engines: int = 4, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                 progress=True, *, device: str = "auto", _client=None, _cluster=None,
                 master_addr: str | None = None):
        import ipyparallel as ipp

        bad = timeout_problems(timeout)
        if _client is None and (not isinstance(engines, int) or isinstance(engines, bool) or engines < 1):
            bad.append(f"engines={engines!r}: a Lab needs a positive whole number of engines; try 4")
        if backend not in ("auto", "gloo", "nccl"):
            bad.append(f"backend={backend!r} is not one of ['auto', 'gloo', 'nccl']; try 'auto'")
        if device not in ("auto", "cpu", "cuda"):
            bad.append(f"device={device!r} is not one of ['auto', 'cpu', 'cuda']; try 'auto'")
        if device == "cpu" and backend == "nccl":
            bad.append("backend='nccl' needs GPUs; use device='auto' or 'cuda', or backend='gloo' on the CPU")
        if not (progress is None or isinstance(progress, bool) or callable(progress)):
            bad.append(f"progress={progress!r} must be True, False or a function of one record")
        if bad:
            raise ConfigError(bad)
        self.timeout = float(timeout)
        self.backend_choice = backend
        self.device_choice = device
        self.progress = progress
        self.master_addr = master_addr
        self._lock = threading.RLock()
        self._cancel_request = threading.Event()
        self._generation = 0
        self._rebuild_needed = False
        self._replace: dict[int, str] = {}     # rank -> why its engine must be replaced
        self._tainted: dict[int, str] = {}     # rank -> why its engine should be replaced (not urgent)
        self.repairs: list[dict] = []
        """One entry per repair: engines replaced (rank -> why), whether all were restarted, seconds."""
        self._known_ids: set[int] = set()
        self.last_config: ParallelConfig | None = None
        """The layout of the last run (what `activate` builds its mesh from)."""
        self.jobs = 0
        """How many calls have started work on the engines (tests check that a refusal starts none)."""
        self.cluster = _cluster
        self.view = None
        if _client is None:
            from traitlets.config import Config

            quick = Config()   # an engine that outlives SIGTERM by 1 s is killed (ipyparallel waits 5 s)
            quick.LocalProcessLauncher.stop_seconds_until_kill = 1
            self.cluster = ipp.Cluster(n=engines, controller_ip="127.0.0.1", engine_timeout=60, log_level=40,
                                       config=quick)
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
            self.ids = sorted(self.client.ids)[: self._n]
            self._known_ids = set(self.client.ids)
            self._setup()
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(cls, profile: str | None = None, url_file: str | None = None, cluster_id: str = "",
                engines: int | None = None, backend: str = "auto", timeout: float = DEFAULT_TIMEOUT_S,
                device: str = "auto",
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
        return cls(backend=backend, timeout=timeout, progress=progress, device=device, _client=client,
                   master_addr=master_addr)

    # -- set-up -----------------------------------------------------------------------------
    def _setup(self) -> None:
        """Give each engine (self.ids, in rank order) a rank and a device and build the world."""
        self.world = len(self.ids)
        self.view = self.client[self.ids]
        got = self._gather({r: self.client[e].apply_async(runtime.engine_info) for r, e in enumerate(self.ids)},
                           START_TIMEOUT_S, watch=False)   # pids are what this learns
        infos = [got[r] for r in range(self.world)]
        self.hosts = [i["host"] for i in infos]
        self.pids = [i["pid"] for i in infos]
        per_host = Counter(self.hosts)
        local_index, seen = [], Counter()
        for h in self.hosts:
            local_index.append(seen[h])
            seen[h] += 1
        own_gpu = all(i["gpus"] >= per_host[h] for i, h in zip(infos, self.hosts))
        has_gpu = all(i["gpus"] > 0 for i in infos)
        if self.device_choice == "cuda" and not has_gpu:
            raise LabError(f"device='cuda' but the engines see {[i['gpus'] for i in infos]} GPUs; use device='cpu'")
        if self.backend_choice == "auto":
            nccl = own_gpu and has_gpu and self.device_choice != "cpu"
            self.backend = "nccl" if nccl else "gloo"
        else:
            self.backend = self.backend_choice
        if self.backend == "nccl" and not own_gpu:
            raise LabError(f"backend='nccl' needs one GPU per engine; hosts have {[i['gpus'] for i in infos]} GPUs "
                           f"for {dict(per_host)} engines. Use device='cuda' (gloo on shared GPUs) or the CPU")
        use_gpu = self.backend == "nccl" or self.device_choice == "cuda"
        self.devices = [f"cuda:{k % max(1, i['gpus'])}" if use_gpu else "cpu" for k, i in zip(local_index, infos)]
        loopback = self.local and len(per_host) == 1
        addr = self.master_addr or ("127.0.0.1" if loopback else infos[0]["addr"])
        threads = [max(1, (os.cpu_count() or 1) // per_host[h]) for h in self.hosts]
        self._rendezvous(addr, threads, loopback)

    def _rendezvous(self, addr: str, threads: list[int], loopback: bool) -> None:
        """A fresh port (the OS picks it on rank 0) and a new process group on every rank."""
        self._generation += 1
        port = self._each(runtime.open_rendezvous, [0], addr, bound=START_TIMEOUT_S)[0]
        got = self._gather({rank: self.client[eid].apply_async(
            runtime.init_distributed, rank, self.world, addr, port, self.backend, self.devices[rank],
            self.timeout, self._generation, threads[rank], loopback) for rank, eid in enumerate(self.ids)},
            START_TIMEOUT_S)
        self.runtimes = [got[r] for r in range(self.world)]
        self.port = port

    # -- running ----------------------------------------------------------------------------
    def apply(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank, with the process group ready; results in rank order.

        fn may come from a notebook, a script or a test module the engines cannot import: it
        is shipped by value (cloudpickle) unless it lives in an installed package. Its
        collectives are in the collective log, so a hang in it is diagnosed like a run's."""
        bad = timeout_problems(timeout)
        if not callable(fn):
            bad.insert(0, f"fn={fn!r} is not callable; pass a function to run on every rank")
        if bad:
            raise ConfigError(bad)
        return self._execute(runtime.call_pickled, (_by_value(fn), *args), kwargs, timeout, None)

    def run(self, cfg: ParallelConfig | None = None, model: ModelConfig | None = None, steps: int = 3,
            seed: int = 0, optim: OptimConfig | None = None, timeout: float | None = None,
            progress=None, return_params: bool = False, audit: bool = False, *, _comm_log: bool = True) -> RunResult:
        """Train `steps` steps of `model` laid out as `cfg` on the engines; returns a RunResult.

        Raises ConfigError (before any engine work) for a layout, model or argument that cannot
        run here, naming each problem and a fix. timeout: seconds (default: the Lab's).
        return_params brings back the final full parameters (res.params) for checking;
        audit runs a TorchDispatchMode beside the comm meter (slow; tests use it).
        _comm_log=False runs without the collective log (only the overhead benchmark does).
        """
        cfg = ParallelConfig() if cfg is None else cfg
        model = ModelConfig() if model is None else model
        optim = OptimConfig() if optim is None else optim
        bad = run_problems(cfg, model, optim, steps, seed, timeout, progress, return_params, audit)
        if bad:
            raise ConfigError(bad)
        validate(cfg, model, self.world)
        if optim_problems(optim):
            raise ConfigError(optim_problems(optim))
        from labkit.engines.mesh import MeshLayout   # a TP group across hosts: say so (mesh.py AXIS_WARNINGS)
        for w in MeshLayout.of(cfg).warnings(self.hosts[:cfg.world]):
            warnings.warn(w, stacklevel=2)
        from labkit.engines.train import run_rank

        spec = RunSpec(parallel=cfg, model=model, optim=optim, steps=steps, seed=seed, return_params=return_params,
                       audit=audit, comm_log=bool(_comm_log)).to_dict()   # plain data crosses to the engines
        t0 = time.perf_counter()
        self.last_config = cfg
        reports = self._execute(run_rank, (spec,), {}, timeout, progress if progress is not None else self.progress)
        return RunResult.from_reports(cfg, model, optim, steps, seed, reports, time.perf_counter() - t0)

    def activate(self, cfg: ParallelConfig | None = None, suffix: str = ""):
        """Register ipyparallel's %px / %%px / %autopx magics on this Lab's engines, in rank order,
        each engine's namespace ready for distributed code: `rank`, `world_size`, `mesh` (the
        labkit Mesh of `cfg`, else of the last run's layout, else dp over every engine: its groups
        built, `mesh.group("dp")`), `device`, `torch` and `dist` (the process group the Lab built).

            lab.activate()
            %%px -e                                   # -e: each engine's (= rank's) outputs together
            t = torch.tensor([float(rank)]); dist.all_reduce(t); print(rank, t)

        The mesh's groups are created collectively through `apply` (bounded and logged like a run).
        Outputs show when the cell ends, grouped per engine in rank order (engine i is rank i in a
        fresh Lab; streaming is turned off, `%pxconfig --stream` turns it back on). The cell runs on
        the engines' own thread, outside the Lab's job machinery: a hang there is not diagnosed
        (interrupt the kernel; the next Lab call repairs the engines).
        After a repair the engines may be new: call activate again. Returns the DirectView.
        """
        from labkit.px import activate

        return activate(self, cfg, suffix)

    def cancel(self) -> None:
        """Stop the call in progress (from any thread): the engines stop at their next step or
        microbatch boundary, and that call raises Cancelled. Does nothing when no call runs."""
        self._cancel_request.set()

    def engine_states(self) -> list[str]:
        """Each rank's job state now ('idle', 'running', 'done', 'error', 'cancelled', or 'dead')."""
        out = []
        with self._lock:
            for r in range(self.world):
                try:
                    out.append(self._each(runtime.poll, [r], 10**9)[r]["state"])
                except _Died:
                    out.append("dead")
        return out

    def _execute(self, fn, args: tuple, kwargs: dict, timeout: float | None, progress) -> list:
        timeout = self.timeout if timeout is None else float(timeout)
        show = print_progress if progress is True else (progress or None)
        steps = StepProgress(show) if show else None
        if not self._lock.acquire(timeout=timeout + 2 * START_TIMEOUT_S):
            raise LabError("the Lab is busy with another call that did not end in time; lab.cancel() stops it")
        try:
            self._cancel_request.clear()
            self._repair_if_needed()
            return self._job(fn, args, kwargs, timeout, steps)
        finally:
            self._lock.release()

    def _job(self, fn, args, kwargs, timeout: float, steps) -> list:
        """Start fn on every rank and poll until every rank is done or something goes wrong."""
        ranks = range(self.world)
        try:
            self._rebuild_needed = True          # until the job ends cleanly
            self._each(runtime.start, ranks, fn, args, kwargs, timeout)
            self.jobs += 1
            deadline = time.monotonic() + timeout
            seen, pause, cancel_sent = [0] * self.world, POLL_MIN_S, False
            while True:
                if self._cancel_request.is_set() and not cancel_sent:
                    self._each(runtime.cancel, ranks)
                    cancel_sent = True
                got = self._gather({r: self._send(r, runtime.poll, seen[r]) for r in ranks}, self._answer_s)
                states = [got[r] for r in ranks]
                for r, s in enumerate(states):
                    seen[r] += len(s["progress"])
                    if steps is not None:
                        for rec in s["progress"]:
                            steps.add(rec)
                kinds = {s["state"] for s in states}
                if kinds == {"done"}:
                    got = self._each(runtime.result, ranks, bound=START_TIMEOUT_S)
                    self._rebuild_needed = False
                    return [got[r] for r in ranks]
                if "error" in kinds:
                    self._on_error(states, timeout)
                if "cancelled" in kinds or ("running" not in kinds and cancel_sent):
                    self._stop_after_cancel()
                    raise Cancelled("the run was cancelled (Lab.cancel); it stopped on every rank")
                if time.monotonic() > deadline:
                    self._on_timeout(timeout)
                time.sleep(pause)
                pause = min(POLL_MAX_S, pause * 1.5)
        except _Died as died:
            self._on_died(died)
        except (LabError, ConfigError):
            raise
        except BaseException:        # Ctrl-C, a progress callback that raised, a broken client
            self._abandon()
            raise

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engines and controller this Lab started (or disconnect from a shared cluster).
        A call still running in another thread is cancelled first (waited for a few seconds)."""
        self._cancel_request.set()
        got = self._lock.acquire(timeout=10.0)
        try:
            try:
                if self.view is not None and not self.local:
                    self._each(runtime.shutdown_distributed, range(self.world), bound=10.0)
            except Exception:
                pass
            try:
                self.client.close()
            except Exception:
                pass
            self._stop_cluster()
        finally:
            if got:
                self._lock.release()

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
