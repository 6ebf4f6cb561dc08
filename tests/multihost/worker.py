"""What every rank runs in the multi-host tests (launched by torchrun inside a namespace host).

    torchrun --nnodes=2 --nproc-per-node=2 ... worker.py train   # DDP vs oracle, hier vs ring
    torchrun ... worker.py kill --victim 3 --at-step 3           # one rank SIGKILLs itself
    torchrun ... worker.py raise --victim 1 --at-step 3          # one rank raises inside the
                                                                 # intra-host phase
    torchrun ... worker.py raise-late --victim 1 --at-step 3     # ... after the all-gather
                                                                 # barrier
    torchrun ... worker.py partition --at-step 5 --steps 300     # says MH_READY at step 5;
                                                                 # the test cuts the link
``--linger S``: after an error, a rank waits S seconds before it exits (and says
``MH_EXIT``), so the tests can tell whether its peers failed because of its error or
only because it exited.

Results go to stdout as ``MH_RESULT <json>`` lines (one per rank) and errors as
``MH_ERROR <json>``, which tests/multihost/test_netns.py parses.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import comm
from gradring.comm import context

IN, HIDDEN, OUT, BATCH = 16, 64, 4, 4  # per-rank batch


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT)).double()


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.randn(world * BATCH, OUT, generator=g, dtype=torch.float64)
    return x, y


def emit(tag: str, **kw: object) -> None:
    """One line in one write(2): lines of different ranks never interleave (< PIPE_BUF)."""
    sys.stdout.flush()
    os.write(1, (f"{tag} " + json.dumps(kw) + "\n").encode())


def where() -> dict:
    ctx = context.context(None)
    hosts = ctx.transports.existing_hosts() if ctx is not None else None
    return {"rank": dist.get_rank(), "host": socket.gethostname(),
            "topology": hosts.topology.describe() if hosts is not None else None,
            "local_rank": hosts.topology.local_rank if hosts is not None else None,
            "shared_memory": hosts is not None and hosts.local is not None}


def train(steps: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = gradring.DistributedDataParallel(model(), bucket_cap_mb=0.01)  # several buckets
    oracle = model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(oracle.parameters(), lr=0.1)
    for step in range(steps):
        x, y = global_batch(step, world)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        opt_o.zero_grad()
        nn.functional.mse_loss(oracle(x), y).backward()
        opt_o.step()
    param_diff = max((a - b).abs().max().item()
                     for a, b in zip(ddp.module.parameters(), oracle.parameters()))

    # The same gradients through the hierarchical and the flat ring all-reduce.
    grads = {}
    for algo in ("hierarchical", "ring"):
        os.environ["GRADRING_ALGO"] = algo
        net = gradring.DistributedDataParallel(model())
        x, y = global_batch(99, world)
        nn.functional.mse_loss(net(x[rank * BATCH:(rank + 1) * BATCH]),
                               y[rank * BATCH:(rank + 1) * BATCH]).backward()
        grads[algo] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    # And one large float32 all-reduce (the ring pipelines it in pieces).
    g = torch.Generator().manual_seed(rank)
    big = torch.randn(3 * 2 ** 18 + 7, generator=g)
    sums = {}
    for algo in ("hierarchical", "ring"):
        os.environ["GRADRING_ALGO"] = algo
        t = big.clone()
        comm.all_reduce(t)
        sums[algo] = t
    os.environ.pop("GRADRING_ALGO")
    every = [torch.randn(big.numel(), generator=torch.Generator().manual_seed(r))
             for r in range(world)]
    emit("MH_RESULT", **where(), param_diff=param_diff,
         grad_diff=(grads["hierarchical"] - grads["ring"]).abs().max().item(),
         sum_diff=(sums["hierarchical"] - sums["ring"]).abs().max().item(),
         sum_err=(sums["hierarchical"] - sum(every)).abs().max().item())


#: Set on the victim rank of ``raise`` for the step it fails in.
_armed = False


def _arm_intra_host_fault() -> None:
    """Make the hierarchical all-reduce raise inside its first intra-host phase (staging
    into shared memory) while ``_armed`` is set."""
    from gradring.comm.algos import hierarchical

    real = hierarchical._copy_except

    def faulty(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
        if _armed:
            raise RuntimeError(f"injected fault in the intra-host phase on rank {dist.get_rank()}")
        real(dst, src, lo, hi)

    hierarchical._copy_except = faulty


def _arm_gather_fault() -> None:
    """Make the hierarchical all-reduce raise right after its all-gather barrier (the
    last barrier before the copies: today's closing agreement has to catch this) while
    ``_armed`` is set; once."""
    from gradring.comm.transports.shm.transport import ShmTransport

    real = ShmTransport.wait_arrivals

    def faulty(self: ShmTransport, what: str = "at a barrier inside the collective") -> None:
        global _armed
        real(self, what)
        if _armed and what == "at a barrier inside the collective":
            _armed = False
            raise RuntimeError(f"injected fault after the all-gather barrier on rank "
                               f"{dist.get_rank()}")

    ShmTransport.wait_arrivals = faulty  # type: ignore[method-assign]


def kill(victim: int, at_step: int, steps: int, linger: float, how: str = "kill") -> None:
    global _armed
    rank = dist.get_rank()
    ddp = gradring.DistributedDataParallel(nn.Linear(256, 256))
    x = torch.randn(8, 256)
    if how == "raise" and rank == victim:
        _arm_intra_host_fault()
    if how == "raise-late" and rank == victim:
        _arm_gather_fault()
    try:
        for step in range(steps):
            if how == "partition" and step == at_step:
                emit("MH_READY", rank=rank, step=step)  # the test may cut the link now
            if rank == victim and step == at_step:
                emit("MH_VICTIM", **where(), step=step)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                _armed = True
            ddp(x).sum().backward()
            comm.all_reduce(torch.ones(1))  # keep every rank in step with the others
    except Exception as exc:  # noqa: BLE001 - reported to the test, then exit non-zero
        emit("MH_ERROR", **where(), error=f"{type(exc).__name__}: {exc}"[:3000], t=time.time())
        sys.stdout.flush()
        time.sleep(linger)
        emit("MH_EXIT", rank=rank)
        os._exit(3)
    emit("MH_RESULT", **where(), finished=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("train", "kill", "raise", "raise-late", "partition"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--victim", type=int, default=3)
    ap.add_argument("--at-step", type=int, default=3)
    ap.add_argument("--linger", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if a.mode == "train":
        train(a.steps)
    else:
        kill(a.victim, a.at_step, a.steps, a.linger, a.mode)
    comm.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
