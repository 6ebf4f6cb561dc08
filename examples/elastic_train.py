"""Restartable training with gradring under torchrun's elastic agent.

Launch (2 processes, one restart allowed; files go to ./elastic-ckpt/):

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/elastic_train.py \
        --steps 20 --ckpt elastic-ckpt/ckpt.pt --out elastic-ckpt/final.pt

    # simulate a crash: rank 1 kills itself (SIGKILL) at step 7 of the first attempt
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 examples/elastic_train.py \
        --steps 20 --ckpt elastic-crash/ckpt.pt --out elastic-crash/final.pt \
        --crash-at 7 --crash-rank 1

Keep checkpoints in a folder of your own (the defaults are under the current
folder), not in a shared one such as /tmp: a checkpoint is a pickle, and one
another user planted there must never be loaded. gradring's checkpoint
functions load weights only and refuse a folder or file that is not yours or
that others may write to, naming it (see [Note: checkpoints other users could
plant] in gradring/tools/checkpoint.py); missing folders are created private
(mode 0700).

Every --every steps rank 0 writes an atomic checkpoint (model, optimizer, step).
After a failure torchrun restarts every worker; they resume from the last
checkpoint, and because each step's data depends only on the step number,
the final parameters equal those of an uninterrupted run.

Without --crash-at, a checkpoint left at --ckpt by an earlier launch is
resumed (a resubmitted job carries on). With --crash-at, the first attempt
always starts from step 0: rank 0 removes a checkpoint an earlier launch left
there, so the crash recipe crashes every time it is run (otherwise the
second run would resume at step 18 and never reach step 7).

Multi-node runs restart more reliably with the agent store unshared (see
``init_distributed``):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 ... examples/elastic_train.py ...
"""

from __future__ import annotations

import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring.tools.checkpoint import load_if_exists, save_atomic, save_on_rank0


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, (x.sum(dim=1, keepdim=True) > 0).float()


def init_distributed() -> None:
    """``init_process_group("gloo")``, kept apart from the store keys of earlier attempts.

    [Note: stale rendezvous keys after a restart]
    torchrun's agent hosts one TCPStore for the whole job and every attempt's
    workers connect to it (``TORCHELASTIC_USE_AGENT_STORE=True``), but
    ``init_process_group`` writes the same key names in every attempt. Gloo
    publishes each rank's listening address under ``default_pg/0//cpu//0/<rank>``;
    a restarted rank that reads a peer's key before the peer rewrote it gets
    the address of a process that no longer exists, and the restart dies in
    ``connectFullMesh`` with "Connection refused" (or hangs). Plain torch DDP
    hits this about half the time too (pytorch/pytorch#135712). Under one
    agent every worker sees the same ``TORCHELASTIC_RESTART_COUNT``, so a
    per-attempt key prefix isolates the attempts. Several agents count
    restarts independently; there, launch with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (rank 0 then hosts a fresh store
    per attempt) and this falls back to the plain call.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1":
        dist.init_process_group("gloo")
        return
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=5))
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}/", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--ckpt", default=os.path.join("elastic-ckpt", "ckpt.pt"),
                    help="checkpoint file (default elastic-ckpt/ckpt.pt); keep it in a "
                         "folder only you can write to")
    ap.add_argument("--out", default=os.path.join("elastic-ckpt", "final.pt"),
                    help="final parameters (default elastic-ckpt/final.pt)")
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=1)
    args = ap.parse_args()

    torch.set_num_threads(1)
    init_distributed()
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = gradring.DistributedDataParallel(
        nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if attempt == 0 and args.crash_at >= 0:
        # The crash demo must reach --crash-at: an earlier launch's checkpoint would
        # resume past it. Restarts (attempt > 0) keep this launch's own checkpoint.
        if rank == 0 and os.path.exists(args.ckpt):
            os.remove(args.ckpt)
            print(f"crash run: removed the checkpoint of an earlier launch at {args.ckpt}",
                  flush=True)
        dist.barrier()
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
        save_atomic(model.module.state_dict(), args.out)
        print(f"attempt {attempt}: finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
