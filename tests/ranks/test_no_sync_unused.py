"""Gradient accumulation under ``no_sync()`` with parameters that some steps or
some ranks do not use, differentially against torch's DDP.

torch's reducer remembers which parameters had a gradient during the
``no_sync`` steps; at the next synchronised backward a parameter counts as used
when any rank used it in any step since the last reduction, and every rank then
receives the reduced gradient (a rank with no local gradient gets the peers'
sum over the world size). The ranks end with identical ``.grad``.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

import gradring


class Switchy(nn.Module):
    """Which branches run depends on the rank and the micro-batch (see ``plan``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 3)
        # One branch per role; ``plan`` says which run.
        self.branches = nn.ModuleDict({k: nn.Linear(3, 1) for k in "abcdef"})
        self.plan: list[str] = ["a"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = 0
        for k in self.plan:
            out = out + self.branches[k](h)
        return out


def _plan(rank: int, micro: int, n_micro: int) -> list[str]:
    """a: every step, every rank. b: only the no_sync steps. c: only rank 1, only
    synced. d: rank 0 in the first micro-batch, rank 1 in the last (torch's
    test_grads_same_across_ranks_with_no_sync). e: only rank 0, only in no_sync.
    f: never."""
    last = micro == n_micro - 1
    plan = ["a"]
    if not last:
        plan.append("b")
    if last and rank == 1:
        plan.append("c")
    if (micro == 0 and rank == 0) or (last and rank == 1):
        plan.append("d")
    if not last and rank == 0:
        plan.append("e")
    return plan


def _run(rank: int, world_size: int, impl: str, kwargs: dict, n_micro: int, steps: int,
         set_to_none: bool) -> list[list[torch.Tensor | None]]:
    torch.manual_seed(0)
    base = Switchy().double()
    cls = gradring.DistributedDataParallel if impl == "gradring" else \
        torch.nn.parallel.DistributedDataParallel
    ddp = cls(copy.deepcopy(base), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(n_micro):
            ddp.module.plan = _plan(rank, micro, n_micro)
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(4, 3, generator=g, dtype=torch.float64)
            ctx = ddp.no_sync() if micro < n_micro - 1 else nullcontext()
            with ctx:
                ddp(x).pow(2).mean().backward()
        seen.append([None if p.grad is None else p.grad.detach().clone()
                     for p in ddp.module.parameters()])
        opt.step()
    return seen


def _both(rank: int, world_size: int, kwargs: dict, n_micro: int, steps: int,
          set_to_none: bool):
    ours = _run(rank, world_size, "gradring", kwargs, n_micro, steps, set_to_none)
    theirs = _run(rank, world_size, "torch", kwargs, n_micro, steps, set_to_none)
    return ours, theirs


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


@pytest.mark.parametrize("n_micro,set_to_none", [(2, True), (3, True), (3, False)])
def test_no_sync_with_unused_matches_torch(pools, n_micro, set_to_none):
    out = pools.run(2, _both, {"find_unused_parameters": True}, n_micro, 2, set_to_none)
    names = [n for n, _ in Switchy().named_parameters()]
    for rank, (ours, theirs) in enumerate(out):
        for step, (g_ours, g_theirs) in enumerate(zip(ours, theirs)):
            for name, a, b in zip(names, g_ours, g_theirs):
                assert _same(a, b), (rank, step, name, a, b)
    # And, as torch's own test checks: every rank ends with the same gradients.
    for step in range(2):
        for k, name in enumerate(names):
            assert _same(out[0][0][step][k], out[1][0][step][k]), (step, name)


def _plain_run(rank, world_size, impl, kwargs, n_micro, steps):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    cls = gradring.DistributedDataParallel if impl == "gradring" else \
        torch.nn.parallel.DistributedDataParallel
    ddp = cls(copy.deepcopy(base), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        # torch's static_graph asserts when its very first backward is under
        # no_sync, so the first step is synchronised; accumulation follows.
        n = 1 if step == 0 else n_micro
        for micro in range(n):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(4, 3, generator=g, dtype=torch.float64)
            with ddp.no_sync() if micro < n - 1 else nullcontext():
                ddp(x).pow(2).mean().backward()
        seen.append([p.grad.detach().clone() for p in ddp.module.parameters()])
        opt.step()
    return seen


def _plain_both(rank, world_size, kwargs, n_micro, steps):
    return (_plain_run(rank, world_size, "gradring", kwargs, n_micro, steps),
            _plain_run(rank, world_size, "torch", kwargs, n_micro, steps))


@pytest.mark.parametrize("kwargs", [{"static_graph": True},
                                    {"static_graph": True, "find_unused_parameters": True}],
                         ids=["static", "static+find_unused"])
def test_no_sync_static_graph_matches_torch(pools, kwargs):
    out = pools.run(2, _plain_both, kwargs, 3, 3)
    for rank, (ours, theirs) in enumerate(out):
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, step)


def _join_run(rank, world_size, impl, n_micro):
    torch.manual_seed(0)
    base = Switchy().double()
    cls = gradring.DistributedDataParallel if impl == "gradring" else \
        torch.nn.parallel.DistributedDataParallel
    ddp = cls(copy.deepcopy(base), find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = 3 if rank == 0 else 2  # uneven: rank 1 joins early
    with Join([ddp]):
        for step in range(steps):
            opt.zero_grad()
            for micro in range(n_micro):
                ddp.module.plan = _plan(rank, micro, n_micro)
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x = torch.randn(4, 3, generator=g, dtype=torch.float64)
                with ddp.no_sync() if micro < n_micro - 1 else nullcontext():
                    ddp(x).pow(2).mean().backward()
            opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _join_both(rank, world_size, n_micro):
    return _join_run(rank, world_size, "gradring", n_micro), \
        _join_run(rank, world_size, "torch", n_micro)


def test_no_sync_with_unused_under_join_matches_torch(pools):
    out = pools.run(2, _join_both, 2)
    for rank, (ours, theirs) in enumerate(out):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), rank
