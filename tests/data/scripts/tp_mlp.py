"""Megatron's MLP with DTensor: ColwiseParallel then RowwiseParallel through parallelize_module, on a
DeviceMesh named "tp", every rank on the same batch.

    torchrun --nproc-per-node 4 tp_mlp.py --steps 2
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self, h=16, f=64):
        super().__init__()
        self.inp = nn.Linear(h, h)  # replicated: the gradient of its output is TP's backward all-reduce
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.inp(x))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = parallelize_module(MLP(), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        loss = model(torch.randn(4, 8, 16, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
