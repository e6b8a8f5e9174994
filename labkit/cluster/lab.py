"""The Lab: an ipyparallel cluster whose engines are the ranks of one torch.distributed world.

    with Lab(engines=4) as lab:                 # local cluster, 127.0.0.1 only
        res = lab.run(ParallelConfig(dp=4), model=ModelConfig(), steps=3)

    Lab(engines=8, launcher="slurm", partition="gpu", time="1:00:00")   # engines from a scheduler
    lab = Lab.connect(profile="slurm")          # a cluster started elsewhere (ipcluster)

The Lab checks arguments and turns results into RunResults; it owns the cluster side as two
objects: its engines (labkit/cluster/startup.py starts or finds them and joins them into one torch
world; labkit/cluster/engine_set.py: processes, the torch world, bounded calls) and
the job runner (labkit/cluster/jobs.py: one job at a time on every rank, polled, its faults turned
into errors by labkit/cluster/faults.py, the repair at the start of the next call). So the notebook
never waits on anything without a bound:
  - a run that does not finish within its timeout becomes a CollectiveTimeout whose message
    is the diagnosis of the ranks' collective logs (labkit.cluster.diagnose);
  - an exception on a rank comes back as a RankError with its rank and traceback, and the
    ranks that were waiting for it in a collective are released (engines/release.py);
  - an engine that dies (or stops answering) becomes EngineDied naming its rank and host;
  - Ctrl-C (KeyboardInterrupt) or Lab.cancel() stops the job on the engines too.
"""

from __future__ import annotations

import time
import warnings

from labkit.cluster import launchers, magics, startup
from labkit.cluster import progress as bars
from labkit.cluster.arguments import run_problems, timeout_problems
from labkit.cluster.gpus import gpu_problems
from labkit.cluster.jobs import JobRunner
from labkit.cluster.script import torchrun as run_script
from labkit.cluster.share import describe as describe_share
from labkit.cluster.shipping import by_value as _by_value
from labkit.cluster.verify_run import verify
from labkit.cluster.world import backend_problems
from labkit.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, RunSpec
from labkit.config.choices import Data, trains_on_text
from labkit.config.table import Rows, card
from labkit.config.validation import data_problems, muon_problems, optim_problems, validate
from labkit.engines import runtime
from labkit.engines.measure import measure_rank
from labkit.layout.mesh import MeshLayout
from labkit.oracle.verify_report import VerifyReport
from labkit.results.measurement import Measurement
from labkit.results.run import RunResult

DEFAULT_TIMEOUT_S = 300.0
"""A run or apply that takes longer is diagnosed as a hang. Generous for CPU demos; pass your own."""


class Lab:
    """A local ipyparallel cluster (or a connection to one) ready to run parallel layouts.

    engines: how many engines (ranks) to start.
    launcher: who starts them, through ipyparallel's launchers (labkit/cluster/launchers.py): 'local'
              (processes here), 'mpi' (mpiexec; hosts={'node': n}, hostfile=, mpi_args=,
              oversubscribe=), 'slurm' (sbatch + srun; partition=, time=, account=, qos=, nodes=,
              gpus_per_task=, sbatch_options=[...]) or 'ssh' (hosts={'node': n}, python=, ssh_cmd=);
              each also takes controller_ip= or interface= (where the controller listens). Every
              process the Lab starts ends within seconds when the kernel dies (labkit/cluster/watchdog.py).
    gpus: None (every GPU), a list of GPU indices, or 'auto' (the least used: labkit/cluster/gpus.py), with
          ranks_per_gpu (for 'auto') and gpu_memory_fraction (each rank's cap on its GPU's memory).
    backend: 'auto' (nccl when every engine has a GPU of its own, see device; else gloo), 'gloo' or 'nccl'.
    device: 'auto' (a GPU each under nccl, else the CPU), 'cpu', or 'cuda': ranks on the GPUs
            even when several share one (NCCL >= 2.30 with at most 2 ranks a GPU, else gloo on
            CUDA tensors: `backend_reason`). NCCL's collectives take CUDA tensors only: code that
            builds CPU tensors says device='cpu' (labkit/cluster/world.py decides).
    timeout: seconds a run or apply may take before it is diagnosed as a hang (default for the
             calls' own `timeout`; each job's process groups time out just after it).
    progress: 'auto' (a bar that updates in place while engines start and runs run: a widget in a
              notebook, text on a terminal, nothing where nobody watches, e.g. tests), True (a
              bar wherever), False (quiet), or a function called with each step's record.

    Thread-safe: one call runs at a time (others wait, bounded); `cancel()` may come from any
    thread (a widget's button) and stops the call in progress.

    engines: the EngineSet (engine ids, pids, the client, the rendezvous port, ...).
    """

    def __init__(
        self,
        engines: int = 4,
        backend: str = "auto",
        timeout: float = DEFAULT_TIMEOUT_S,
        progress="auto",
        *,
        device: str = "auto",
        launcher: str = "local",
        gpus=None,
        ranks_per_gpu: int | None = None,
        gpu_memory_fraction: float | None = None,
        _client=None,
        _cluster=None,
        master_addr: str | None = None,
        **launcher_options,
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
        if not (progress is None or progress == "auto" or isinstance(progress, bool) or callable(progress)):
            bad.append(f"progress={progress!r} must be 'auto', True, False or a function of one record")
        if _client is None:
            bad += launchers.launcher_problems(launcher, engines, launcher_options)
            bad += gpu_problems(gpus, launcher, ranks_per_gpu, gpu_memory_fraction)
        elif launcher_options:
            bad.append(
                f"{sorted(launcher_options)}: unknown arguments (launcher options need a Lab that starts its cluster)"
            )
        if bad:
            raise ConfigError(bad)
        self.timeout = float(timeout)
        self.progress = progress
        self.last_config: ParallelConfig | None = None
        """The layout of the last run (what `activate` builds its mesh from)."""
        choices = dict(backend=backend, device=device, timeout=self.timeout, master_addr=master_addr)
        gpu = dict(gpus=gpus, ranks_per_gpu=ranks_per_gpu, gpu_memory_fraction=gpu_memory_fraction)
        self.engines = startup.open_engines(
            engines, launcher, launcher_options, gpu, choices, progress, _client, _cluster
        )
        self._runner = JobRunner(self.engines)

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
        progress="auto",
        master_addr: str | None = None,
        **client_kwargs,
    ) -> Lab:
        """Attach to a running ipyparallel cluster (`ipcluster start` with any launcher).

        The connection uses the cluster's connection file (ipcontroller-client.json), which
        carries its authentication key: no unauthenticated port is ever used. `engines` waits
        for that many engines first. The rendezvous listens on rank 0's address (override
        with master_addr when that host has several).
        """
        client = startup.connect(profile, url_file, cluster_id, engines, **client_kwargs)
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
    def share(self) -> Rows:
        """What of this machine the engines use, per host: which cores (and why those: the kernel's
        CPU affinity, a quota), threads per engine, which GPUs and each rank's cap on them; the
        rule that Labs sharing a machine follow is labkit/cluster/share.py's."""
        return self.engines.share

    backend_reason = property(lambda self: self.engines.backend_reason, doc="Why NCCL or gloo where ranks share GPUs.")

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
        return self._execute(runtime.call_pickled, (_by_value(fn), *args), kwargs, timeout, False)

    def measure(self, fn, *args, timeout: float | None = None, **kwargs) -> Measurement:
        """fn(*args, **kwargs) on every rank, as `apply` runs it, under the comm, memory and
        timeline meters; returns a Measurement with the views of a run (`comm_table()`, each
        rank's `memory` and `timeline`, `trace()`, the figures and the Dashboard's panels).

        Inside fn, `labkit.track(model, optimizer, mesh)` names what to follow: the model's
        forward and backward and the optimizer's step become phases, steps and timeline spans,
        their tensors the model states in memory, and the mesh (a DeviceMesh or a labkit Mesh)
        names each collective's dim — without one, a collective is named by its group's ranks.
        fn may instead return its modules and optimizer. `with labkit.region("name"):` marks a
        span of its own. Every collective is seen, whoever issues it (DDP, FSDP2, DTensor, the
        user's own); a hang or an exception in fn is diagnosed like a run's
        (engines/tracking.py says how the phases are found)."""
        bad = timeout_problems(timeout)
        if not callable(fn):
            bad.insert(0, f"fn={fn!r} is not callable; pass a function to run on every rank")
        if bad:
            raise ConfigError(bad)
        t0 = time.perf_counter()
        reports = self._execute(measure_rank, (_by_value(fn), *args), kwargs, timeout, self.progress, None, "measure")
        return Measurement.from_reports(reports, time.perf_counter() - t0)

    def torchrun(
        self, script: str, *args, module: bool = False, cwd=None, env=None, timeout=None, echo=True, progress=None
    ):
        """`torchrun --nproc-per-node <ranks> script *args` on the engines: the script unmodified, one
        process per rank under torchrun's contract (its variables, init_process_group() / env://, argv,
        __main__, exit codes), measured; returns a ScriptResult (a Measurement: comm_table(), memory,
        timeline, the figures; exit_codes, stdout, stderr). module=True: `python -m script`; cwd: the
        working directory (the notebook's); env: variables over the engines' own; echo: whose lines to
        print as they come (True, False, a list of ranks). A failing rank stops the others and raises
        ScriptFailed (torchrun's summary); a hang is a diagnosed CollectiveTimeout; Ctrl-C stops every
        rank; nothing outlives the call (labkit/cluster/script/)."""
        return run_script(
            self, script, args, module=module, cwd=cwd, env=env, timeout=timeout, echo=echo, progress=progress
        )

    def verify(self, build, parallelize, mesh: dict, batch, loss, **options) -> VerifyReport:
        """Is the user's parallel code right? `build()` -> their nn.Module (one process), trained
        here as the reference; `parallelize(model, mesh)` -> the model as they parallelize it (DDP,
        FSDP2, DTensor plans, pipeline stages, their own collectives; may work in place), run on the
        engines on a DeviceMesh of `mesh` (named sizes, e.g. {"dp": 2, "tp": 2}); `batch(step)` ->
        the global batch; `loss(model, batch)` -> a scalar. Options: optimizer(params) (AdamW lr 1e-3),
        steps (2), step(model, batch, ctx) (a rank's forward and backward: its own data, microbatches
        or schedule; default: ctx.shard(batch), the loss, backward), precision ('fp32' / 'bf16'
        bounds), data_dims (dims that split the batch; default those named dp*, fsdp), seed, timeout.
        Returns a VerifyReport (labkit/oracle/verify.py says what is compared, and how)."""
        return verify(self, build, parallelize, mesh, batch, loss, **options)

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
        data: Data = "synthetic",
        locate: bool = False,
        _comm_log: bool = True,
    ) -> RunResult:
        """Train `steps` steps of `model` laid out as `cfg` on the engines; returns a RunResult.

        Raises ConfigError (before any engine work) for a layout, model or argument that cannot
        run here, naming each problem and a fix. timeout: seconds (default: the Lab's).
        return_params brings back the final full parameters (res.params) and every step's reduced
        gradients (res.step_grads), what the oracle replays to check the run (labkit/oracle/replay.py);
        audit runs a TorchDispatchMode beside the comm meter (slow; tests use it).
        data: 'synthetic' (the synthetic language) or 'text' (the Shakespeare corpus in bytes,
        labkit/layout/text.py; needs vocab >= 256): then the ranks also compute the validation loss
        (res.validation_loss) and the parameters come back, so that res.generate(prompt, tokens) works.
        locate=True records step 0's every module output and gradient on every rank, for res.located(ref).
        _comm_log=False runs without the collective log (only the overhead benchmark does).
        """
        cfg = ParallelConfig() if cfg is None else cfg
        model = ModelConfig() if model is None else model
        optim = OptimConfig() if optim is None else optim
        # every argument's problem at once, before any engine work
        bad = run_problems(cfg, model, optim, steps, seed, timeout, progress, return_params, audit, locate)
        bad += data_problems(data, model)
        if bad:
            raise ConfigError(bad)
        validate(cfg, model, self.world)
        found = optim_problems(optim) or muon_problems(cfg, model, optim)
        found = found or backend_problems(cfg, self.backend, self.devices[: cfg.world])
        if found:
            raise ConfigError(found)
        for w in MeshLayout.of(cfg).warnings(self.hosts[: cfg.world]):  # a TP group across hosts: say so
            warnings.warn(w, stacklevel=2)
        spec = RunSpec(
            parallel=cfg,
            model=model,
            optim=optim,
            steps=steps,
            seed=seed,
            data=data,
            return_params=return_params or trains_on_text(data),  # generate() samples from them
            return_grads=return_params,  # what the oracle replays: a check asked for, not a text run's sampling
            audit=audit,
            locate=locate,
            comm_log=bool(_comm_log),
        ).to_dict()  # plain data crosses to the engines
        t0 = time.perf_counter()
        self.last_config = cfg
        shown = progress if progress is not None else self.progress
        # named, not imported: engines/train.py imports torch, which the kernel never loads (~150 MB)
        target = ("labkit.engines.train:run_rank", spec)
        reports = self._execute(runtime.call_named, target, {}, timeout, shown, steps, "steps")
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
        `%%torchrun args` runs a cell as a training script on every rank (Lab.torchrun).
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

    def _execute(
        self, fn, args: tuple, kwargs: dict, timeout: float | None, progress, total=None, label: str = ""
    ) -> list:
        """fn on every rank through the job runner; `progress` as the Lab's (see the class), a bar
        of `total` steps (None: a count) called `label`."""
        timeout = self.timeout if timeout is None else float(timeout)
        with bars.shown(progress, total, label) as steps:
            return self._runner.run(fn, args, kwargs, timeout, steps)

    # -- lifetime ---------------------------------------------------------------------------
    def restart(self) -> None:
        """Replace every engine and rebuild the process groups (what the repair falls back to)."""
        self._runner.restart()

    def close(self) -> None:
        """Stop the engines and controller this Lab started (or disconnect from a shared cluster).
        A call still running in another thread is cancelled first (waited for a few seconds)."""
        # a call still running in another thread stops first, so that the engines close idle
        self._runner.cancel()
        self.engines.close(wait=10.0)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Lab(engines={self.world}, backend={self.backend!r}, hosts={sorted(set(self.hosts))}, "
            f"share={describe_share(self.share)!r})"
        )

    def _repr_html_(self) -> str:
        ranks = Rows(
            {"rank": r, "host": h, "device": d, "pid": p}
            for r, (h, d, p) in enumerate(zip(self.hosts, self.devices, self.engines.pids))
        )
        last = self.last_config
        facts = [
            ("engines", f"{self.world} ranks, {self.backend} on {', '.join(sorted(set(self.devices)))}"),
            *[("backend", why) for why in [self.backend_reason] if why],
            ("hosts", ", ".join(sorted(set(self.hosts)))),
            ("share", describe_share(self.share)),
            ("last layout", MeshLayout.of(last).describe() if last else "none run yet"),
            ("jobs", f"{self.jobs} run, {len(self.repairs)} repair(s)"),
        ]
        return card("Lab", facts, [("ranks", ranks)])
