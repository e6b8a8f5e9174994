"""A stack of linear layers cut into one stage per rank with torch.distributed.pipelining: each rank
builds its own stage's layers, a PipelineStage, and runs GPipe over the microbatches.

    torchrun --nproc-per-node 4 pipeline_mlp.py --steps 2 --microbatches 4
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

H = 32


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    stage_module = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=lambda out, y: (out - y).pow(2).mean())
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x = torch.randn(8, H, generator=g)
        y = torch.randn(8, H, generator=g)
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
            print(f"step {step} loss {torch.stack(losses).mean().item():.4f}", flush=True)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
