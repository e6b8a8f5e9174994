"""Engines that Slurm (through sbatch) and mpiexec start, through ipyparallel's own launchers: each
Lab trains a layout that matches the one-process reference, and once closed leaves nothing behind
(no job in Slurm's queue, no process of the Lab). One Lab per launcher, two engines, a tiny model."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
from conftest import TINY
from launch_tools import need, slurm, slurm_jobs  # noqa: F401  (slurm: a fixture)

from labkit import Lab, ParallelConfig
from labkit.cluster.launchers import batch_file
from labkit.oracle.checks import assert_matches

SCRIPTS = pathlib.Path(__file__).parent / "data" / "scripts"

pytestmark = pytest.mark.slow


def _env(name: str):
    return os.environ.get(name)  # on the engine


def _a_script_trains(lab) -> None:
    """A script under torchrun's contract on this launcher's engines: a world of its own (its store on
    rank 0's engine), its DTensor TP's forward and backward all-reduce on each rank."""
    script = lab.torchrun(str(SCRIPTS / "tp_mlp.py"), "--steps", "1", echo=False)
    assert script.ok and script.steps_seen == [1, 1]
    assert [sorted(e.phase for e in rk.comm if e.dim == "tp" and e.step == 0) for rk in script.ranks] == [
        ["backward", "forward"]
    ] * 2


def _gone(lab, job_ids=(), within: float = 10.0) -> float:
    """Seconds until neither the Lab's processes nor its jobs are left (fails past `within`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if not lab.engines.processes() and not set(job_ids) & set(slurm_jobs() if job_ids else ()):
            return time.monotonic() - t0
        time.sleep(0.1)
    pytest.fail(f"left after close: {lab.engines.processes()}, jobs {set(job_ids) & set(slurm_jobs())}")


def test_a_lab_whose_engines_slurm_launches(slurm, ref_cache, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)  # the notebook's folder: ipyparallel would write its batch script here
    t0 = time.perf_counter()
    lab = Lab(
        engines=2, launcher="slurm", controller_ip="127.0.0.1", time="10", progress=False, device="cpu", timeout=120
    )
    try:
        started = time.perf_counter() - t0
        jobs = [cmd[-1] for cmd in lab.engines.started.cancels]
        assert len(jobs) == 1 and jobs[0] in slurm_jobs()
        assert lab.apply(_env, "SLURM_JOB_ID") == jobs * 2  # both engines inside the one job
        script = pathlib.Path(batch_file(lab.engines.cluster))
        assert script.is_file() and list(tmp_path.iterdir()) == []  # with the cluster's files, not the user's
        res = lab.run(ParallelConfig(dp=2), model=TINY, steps=3, return_params=True)
        assert_matches(res, ref_cache())
        _a_script_trains(lab)  # on engines inside the Slurm job
    finally:
        lab.close()
    after = _gone(lab, jobs)
    assert not script.exists()  # removed with the cluster
    print(f"\nslurm: Lab(engines=2) started in {started:.1f} s (sbatch, srun); closed, all gone in {after:.1f} s")


def test_a_lab_whose_engines_mpiexec_starts(ref_cache):
    need("mpiexec")
    t0 = time.perf_counter()
    lab = Lab(engines=2, launcher="mpi", oversubscribe=True, progress=False, device="cpu", timeout=120)
    try:
        started = time.perf_counter() - t0
        # ranks in mpiexec's order (engine ids follow registration, which races)
        assert lab.apply(_env, "OMPI_COMM_WORLD_RANK") == ["0", "1"]
        res = lab.run(ParallelConfig(tp=2), model=TINY, steps=3, return_params=True)
        assert_matches(res, ref_cache())
        _a_script_trains(lab)  # on engines mpiexec started
    finally:
        lab.close()
    after = _gone(lab)
    print(f"\nmpi: Lab(engines=2) started in {started:.1f} s (mpiexec); closed, processes gone in {after:.1f} s")
