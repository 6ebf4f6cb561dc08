"""Restartable training with gradring under torchrun's elastic agent.

Launch (2 processes, one restart allowed):

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/elastic_train.py \
        --steps 20 --ckpt /tmp/elastic/ckpt.pt --out /tmp/elastic/final.pt

    # simulate a crash: rank 1 kills itself (SIGKILL) at step 7 of the first attempt
    torchrun ... examples/elastic_train.py ... --crash-at 7 --crash-rank 1

Every --every steps rank 0 writes an atomic checkpoint (model, optimizer, step).
After a failure torchrun restarts every worker; they resume from the last
checkpoint, and because each step's data depends only on the step number,
the final parameters equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring.checkpoint import load_if_exists, save_on_rank0


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = gradring.DistributedDataParallel(
        nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    state = load_if_exists(args.ckpt)
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        if rank == 0:
            print(f"attempt {attempt}: resuming from step {start}", flush=True)
    for step in range(start, args.steps):
        if attempt == 0 and step == args.crash_at and rank == args.crash_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a hard crash, no cleanup
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()
        if (step + 1) % args.every == 0:
            save_on_rank0({"model": model.module.state_dict(), "optim": opt.state_dict(),
                           "step": step + 1}, args.ckpt)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
        print(f"attempt {attempt}: finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
