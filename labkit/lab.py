"""The Lab: an ipyparallel cluster whose engines are the ranks of one torch.distributed world.

    with Lab(engines=4) as lab:                 # local cluster, 127.0.0.1 only
        res = lab.run(ParallelConfig(dp=4), model=ModelConfig(), steps=3)

    lab = Lab.connect(profile="slurm")          # a cluster started elsewhere (ipcluster)

The Lab checks arguments and turns results into RunResults; it owns the cluster side as two
objects: its engines (labkit/engine_set.py: processes, the torch world, bounded calls) and
the job runner (labkit/jobs.py: one job at a time on every rank, polled, its faults turned
into errors by labkit/faults.py, the repair at the start of the next call). So the notebook
never waits on anything without a bound:
  - a run that does not finish within its timeout becomes a CollectiveTimeout whose message
    is the diagnosis of the ranks' collective logs (labkit.diagnose);
  - an exception on a rank comes back as a RankError with its rank and traceback, and the
    ranks that were waiting for it in a collective are released (engines/release.py);
  - an engine that dies (or stops answering) becomes EngineDied naming its rank and host;
  - Ctrl-C (KeyboardInterrupt) or Lab.cancel() stops the job on the engines too.
"""

from __future__ import annotations

import sys
import time
import warnings

import cloudpickle

from labkit import engine_set, magics
from labkit.arguments import run_problems, timeout_problems
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunSpec
from labkit.engine_set import EngineSet
from labkit.engines import runtime
from labkit.jobs import JobRunner
from labkit.plans.mesh import MeshLayout
from labkit.progress import StepProgress, print_progress
from labkit.results import RunResult
from labkit.validation import data_problems, optim_problems, validate
from labkit.world import layout_problems

DEFAULT_TIMEOUT_S = 300.0
"""A run or apply that takes longer is diagnosed as a hang. Generous for CPU demos; pass your own."""


def _by_value(fn) -> bytes:
    """Pickle fn so an engine can run it: by value when its module is not an installed package."""
    mod = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(mod, "__file__", None) or ""
    installed = "site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)
    if mod is not None and mod.__name__ != "__main__" and not installed and not mod.__name__.startswith("labkit"):
        cloudpickle.register_pickle_by_value(mod)
    return cloudpickle.dumps(fn)


class Lab:
    """A local ipyparallel cluster (or a connection to one) ready to run parallel layouts.

    engines: how many engines (ranks) to start locally.
    backend: 'auto' (nccl when every engine has a GPU of its own, else gloo), 'gloo' or 'nccl'.
    device: 'auto' (a GPU each under nccl, else the CPU), 'cpu', or 'cuda': ranks on the GPUs
            even when several share one — NCCL refuses two ranks on one GPU, so with more engines
            than GPUs 'cuda' runs gloo on CUDA tensors (a classroom on one GPU server).
            'auto' on a host with a GPU per engine is NCCL, where collectives take CUDA tensors
            only: code that builds CPU tensors says device='cpu' (labkit/world.py decides).
    timeout: seconds a run or apply may take before it is diagnosed as a hang (default for the
             calls' own `timeout`; each job's process groups time out just after it).
    progress: print one line per step (True), stay quiet (False), or call progress(record).

    Thread-safe: one call runs at a time (others wait, bounded); `cancel()` may come from any
    thread (a widget's button) and stops the call in progress.

    engines: the EngineSet (engine ids, pids, the client, the rendezvous port, ...).
    """

    def __init__(
        self,
        engines: int = 4,
        backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        progress=True,
        *,
        device: str = "auto",
        _client=None,
        _cluster=None,
        master_addr: str | None = None,
    ):
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
        self.progress = progress
        self.last_config: ParallelConfig | None = None
        """The layout of the last run (what `activate` builds its mesh from)."""
        choices = dict(backend=backend, device=device, timeout=self.timeout, master_addr=master_addr)
        if _client is None:
            cluster, client = engine_set.start_local(engines)
            self.engines = EngineSet(client, cluster, engines, local=True, **choices)
        else:
            self.engines = EngineSet(_client, _cluster, local=False, **choices)
        self._runner = JobRunner(self.engines)
        try:
            self.engines.setup()
        except BaseException:
            self.close()
            raise

    @classmethod
    def connect(
        cls,
        profile: str | None = None,
        url_file: str | None = None,
        cluster_id: str = "",
        engines: int | None = None,
        backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        device: str = "auto",
        progress=True,
        master_addr: str | None = None,
        **client_kwargs,
    ) -> Lab:
        """Attach to a running ipyparallel cluster (`ipcluster start` with any launcher).

        The connection uses the cluster's connection file (ipcontroller-client.json), which
        carries its authentication key: no unauthenticated port is ever used. `engines` waits
        for that many engines first. The rendezvous listens on rank 0's address (override
        with master_addr when that host has several).
        """
        client = engine_set.connect(profile, url_file, cluster_id, engines, **client_kwargs)
        return cls(
            backend=backend, timeout=timeout, progress=progress, device=device, _client=client, master_addr=master_addr
        )

    # -- what the engines are --------------------------------------------------------------
    @property
    def world(self) -> int:
        """How many ranks (engines)."""
        return self.engines.world

    @property
    def hosts(self) -> list[str]:
        """Each rank's host."""
        return self.engines.hosts

    @property
    def devices(self) -> list[str]:
        """Each rank's device ('cpu' or 'cuda:N')."""
        return self.engines.devices

    @property
    def backend(self) -> str:
        """The process groups' backend: 'gloo' or 'nccl'."""
        return self.engines.backend

    @property
    def repairs(self) -> list[dict]:
        """One entry per repair: engines replaced (rank -> why), whether all were restarted, seconds."""
        return self._runner.repairs

    @property
    def jobs(self) -> int:
        """How many calls have started work on the engines (tests check that a refusal starts none)."""
        return self._runner.jobs

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

    def run(
        self,
        cfg: ParallelConfig | None = None,
        model: ModelConfig | None = None,
        steps: int = 3,
        seed: int = 0,
        optim: OptimConfig | None = None,
        timeout: float | None = None,
        progress=None,
        return_params: bool = False,
        audit: bool = False,
        *,
        data: str = "synthetic",
        _comm_log: bool = True,
    ) -> RunResult:
        """Train `steps` steps of `model` laid out as `cfg` on the engines; returns a RunResult.

        Raises ConfigError (before any engine work) for a layout, model or argument that cannot
        run here, naming each problem and a fix. timeout: seconds (default: the Lab's).
        return_params brings back the final full parameters (res.params) for checking;
        audit runs a TorchDispatchMode beside the comm meter (slow; tests use it).
        data: 'synthetic' (the synthetic language) or 'text' (the Shakespeare corpus in bytes,
        labkit/plans/text.py; needs vocab >= 256): then the ranks also compute the validation loss
        (res.validation_loss) and the parameters come back, so that res.generate(prompt, tokens) works.
        _comm_log=False runs without the collective log (only the overhead benchmark does).
        """
        cfg = ParallelConfig() if cfg is None else cfg
        model = ModelConfig() if model is None else model
        optim = OptimConfig() if optim is None else optim
        bad = run_problems(cfg, model, optim, steps, seed, timeout, progress, return_params, audit)
        bad += data_problems(data, model)
        if bad:
            raise ConfigError(bad)
        validate(cfg, model, self.world)
        if optim_problems(optim):
            raise ConfigError(optim_problems(optim))
        if layout_problems(cfg, self.backend, self.devices[: cfg.world]):
            raise ConfigError(layout_problems(cfg, self.backend, self.devices[: cfg.world]))
        for w in MeshLayout.of(cfg).warnings(self.hosts[: cfg.world]):  # a TP group across hosts: say so
            warnings.warn(w, stacklevel=2)
        from labkit.engines.train import (
            run_rank,  # imports torch: loaded at the first run, not with the Lab
        )

        spec = RunSpec(
            parallel=cfg,
            model=model,
            optim=optim,
            steps=steps,
            seed=seed,
            data=data,
            return_params=return_params or data == "text",  # generate() samples from them
            audit=audit,
            comm_log=bool(_comm_log),
        ).to_dict()  # plain data crosses to the engines
        t0 = time.perf_counter()
        self.last_config = cfg
        reports = self._execute(run_rank, (spec,), {}, timeout, progress if progress is not None else self.progress)
        return RunResult.from_reports(cfg, model, optim, steps, seed, reports, time.perf_counter() - t0, data)

    def activate(self, cfg: ParallelConfig | None = None, suffix: str = ""):
        """Register ipyparallel's %px / %%px / %autopx magics on this Lab's engines, in rank order,
        each engine's namespace ready for distributed code: `rank`, `world_size`, `mesh` (the
        labkit Mesh of `cfg`, else of the last run's layout, else dp over every engine: its groups
        built, `mesh.group("dp")`), `device`, `torch` and `dist` (the process group the Lab built).

            lab.activate()
            %%px -e                                   # -e: each engine's (= rank's) outputs together
            t = torch.tensor([float(rank)], device=device); dist.all_reduce(t); print(rank, t)

        The mesh's groups are created collectively through `apply` (bounded and logged like a run).
        Outputs show when the cell ends, grouped per engine in rank order (engine i is rank i in a
        fresh Lab; streaming is turned off, `%pxconfig --stream` turns it back on). The cell runs on
        the engines' own thread, outside the Lab's job machinery: a hang there is not diagnosed
        (interrupt the kernel; the next Lab call repairs the engines).
        After a repair the engines may be new: call activate again. Returns the DirectView.
        """
        return magics.activate(self, cfg, suffix)

    def cancel(self) -> None:
        """Stop the call in progress (from any thread): the engines stop at their next step or
        microbatch boundary, and that call raises Cancelled. Does nothing when no call runs."""
        self._runner.cancel()

    def engine_states(self) -> list[str]:
        """Each rank's job state now ('idle', 'running', 'done', 'error', 'cancelled', or 'dead')."""
        return self._runner.states()

    def _execute(self, fn, args: tuple, kwargs: dict, timeout: float | None, progress) -> list:
        timeout = self.timeout if timeout is None else float(timeout)
        show = print_progress if progress is True else (progress or None)
        return self._runner.run(fn, args, kwargs, timeout, StepProgress(show) if show else None)

    # -- lifetime ---------------------------------------------------------------------------
    def restart(self) -> None:
        """Replace every engine and rebuild the process groups (what the repair falls back to)."""
        self._runner.restart()

    def close(self) -> None:
        """Stop the engines and controller this Lab started (or disconnect from a shared cluster).
        A call still running in another thread is cancelled first (waited for a few seconds)."""
        self._runner.cancel()
        self.engines.close(wait=10.0)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lab(engines={self.world}, backend={self.backend!r}, hosts={sorted(set(self.hosts))})"
