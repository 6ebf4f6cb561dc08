"""Train a small regression model with gradring's DDP.

One process (no launcher; gradring makes a 1-rank group itself):

    python examples/quickstart.py

Two processes on this machine (ranks talk through shared memory):

    torchrun --standalone --nproc-per-node=2 examples/quickstart.py

Two nodes with 2 processes each (run on both; node 0's address in MASTER):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=$MASTER:29500 --rdzv-id=quickstart examples/quickstart.py

Each rank trains on its own slice of every global batch; gradients are
averaged when ``loss.backward()`` returns, so every replica takes the same step.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import gradring


def main() -> None:
    torch.set_num_threads(1)  # one intra-op thread per rank: ranks share the cores
    if "RANK" not in os.environ:  # plain `python`: a group of one, in this process
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(),
                                                           nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    per_rank = 32
    for step in range(200):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(per_rank * world, 16, generator=g)
        y = x @ true_w
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # averaged across ranks here
        opt.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"done on {world} rank(s); final loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
