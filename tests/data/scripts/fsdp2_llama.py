"""A Hugging Face Llama under FSDP2's fully_shard, as the FSDP2 tutorial writes it: each decoder
layer, then the whole model, on a one-dimensional DeviceMesh named "dp"; gradient clipping.

    torchrun --nproc-per-node 4 fsdp2_llama.py --config config.json --steps 2
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    args = p.parse_args()
    dist.init_process_group()  # env://, the backend PyTorch picks: gloo for the CPU
    torch.manual_seed(0)
    config = LlamaConfig.from_json_file(args.config)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        print(f"rank {dist.get_rank()} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
