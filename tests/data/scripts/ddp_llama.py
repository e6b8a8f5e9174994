"""A Hugging Face Llama under PyTorch's DDP, as the DDP tutorial writes it: torchrun starts it.

    torchrun --nproc-per-node 4 ddp_llama.py --config config.json --steps 3

--straggler R: rank R skips the last step's loss all-reduce and goes on to write its checkpoint, while
the others wait for it in that all-reduce (a rank that skips a collective: the hang of notebook 17).
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM


def save_checkpoint(model, seconds):
    time.sleep(seconds)  # a slow filesystem


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--straggler", type=int, default=-1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    config = LlamaConfig.from_json_file(args.config)
    model = DDP(LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if rank == args.straggler and step == args.steps - 1:
            save_checkpoint(model, 600)
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
