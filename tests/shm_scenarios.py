"""Rank side of the shared-memory hardening tests (run by ``tests/shm_jobs.py``).

Each scenario is ``fn(rank, world, tmp) -> hard_exit``; it prints JSON reports
with :func:`tests.shm_jobs.say`. A true return value makes the rank leave with
``os._exit`` (its process group may be wedged by a failed peer).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

import gradring
from gradring import comm
from tests.shm_jobs import say


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------- 1: small /dev/shm
def _train(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        ddp(torch.randn(4, 2048, generator=g)).pow(2).mean().backward()
        opt.step()


def small_shm(rank: int, world: int, tmp: str) -> bool:
    """A ~16 MiB model on an 8 MiB /dev/shm, against torch's DDP over gloo."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 8))
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    try:
        _train(gradring.DistributedDataParallel(ours), rank)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(rank=rank, error=_error(exc))
        return True
    _train(nn.parallel.DistributedDataParallel(theirs), rank)
    diff = max((a - b).abs().max().item() for a, b in zip(ours.parameters(),
                                                          theirs.parameters()))
    say(rank=rank, error=None, diff=diff)
    comm.shutdown()
    return False


def small_shm_forced(rank: int, world: int, tmp: str) -> bool:
    """GRADRING_TRANSPORT=shm on an 8 MiB /dev/shm: no fallback allowed."""
    os.environ["GRADRING_TRANSPORT"] = "shm"
    x = torch.ones(4 << 20)  # 16 MiB: its staging buffer cannot fit
    try:
        comm.all_reduce(x)
        say(rank=rank, error=None, value=float(x[0]))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        say(rank=rank, error=_error(exc))
    comm.shutdown()
    return False
