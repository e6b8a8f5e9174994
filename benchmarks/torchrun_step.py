"""The same training step a warm Lab re-runs, launched afresh the way one would without a Lab.

    torchrun --nproc-per-node 4 benchmarks/torchrun_step.py '<spec json>'

spec is what Lab.run sends each engine: a labkit.config.RunSpec as plain data (its to_dict()).
Each process joins the gloo group from torchrun's environment and runs labkit's own
`engines.train.run_rank` — the same mesh, model, strategy and meters — so the only difference
from a warm Lab is what a fresh launch costs: starting Python, importing torch and labkit,
the rendezvous, building the process groups. benchmarks/run.py times the whole subprocess.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from labkit.config import RunSpec
from labkit.engines import runtime
from labkit.engines.meters import comm
from labkit.engines.train import run_rank


def main(spec: dict) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    comm.install()
    runtime._state.runtime = runtime.Runtime(rank, world, "gloo", "cpu", socket.gethostname(), 60.0, 0)
    report = run_rank(RunSpec.from_dict(spec).replace(return_params=False, audit=False).to_dict())
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"losses": report["losses"], "step_times": report["step_times"]}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    # After the group is destroyed, about 1 exit in 5 here aborts in a C++ destructor ("terminate
    # called without an active exception", torch 2.13 CPU, gloo) and torchrun then fails the whole
    # launch: the step is done and reported, so leave without running the static destructors.
    os._exit(0)
