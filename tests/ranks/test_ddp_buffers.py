"""Buffers sync from rank 0 before every forward, as in torch's DDP: changed by a
forward, reassigned to a new tensor (also under join), registered, swapped,
resized or replaced between forwards."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from tests.support.side_by_side import IMPLS


def _buffers_each_forward(rank, world_size):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ddp = gradring.DistributedDataParallel(model)
    x = torch.randn(8, 4) + rank
    ddp(x).sum().backward()
    # Each rank's BN now has local statistics; the next forward broadcasts rank 0's.
    before = model[1].running_mean.clone()
    ddp.eval()
    ddp(x)
    after = model[1].running_mean.clone()
    everyone = [torch.empty_like(after) for _ in range(world_size)]
    dist.all_gather(everyone, after)
    return all(torch.equal(everyone[0], e) for e in everyone), torch.equal(before, after)


def test_buffers_broadcast_before_forward(pools):
    for same_everywhere, _ in pools.run(2, _buffers_each_forward):
        assert same_everywhere


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.seen


def _reassigned_buffer(rank, world_size, where):
    torch.manual_seed(0)
    base = _Counter().double()
    out = {}
    for name, cls in IMPLS.items():
        model = copy.deepcopy(base)
        ddp = cls(model)
        seen = []
        for step in range(3):
            # A new tensor each time, different on every rank.
            model.seen = model.seen + (rank + 1) * (step + 1)
            y = ddp(torch.ones(2, 3, dtype=torch.float64))
            seen.append((model.seen.clone(), y.detach().clone()))
            y.sum().backward()
        if where == "join":
            with ddp.join():
                model.seen = model.seen + 100 * (rank + 1)
                ddp(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
            seen.append((model.seen.clone(), None))
        out[name] = seen
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reassigned_buffer_is_broadcast_from_rank0(pools, world_size):
    for r in pools.run(world_size, _reassigned_buffer, "forward"):
        for (buf_m, y_m), (buf_t, y_t) in zip(r["gradring"], r["torch"]):
            assert torch.equal(buf_m, buf_t) and torch.equal(y_m, y_t)


def test_reassigned_buffer_under_join(pools):
    # Join's final sync also reads the buffer the module holds now.
    for r in pools.run(2, _reassigned_buffer, "join"):
        for (buf_m, _), (buf_t, _) in zip(r["gradring"], r["torch"]):
            assert torch.equal(buf_m, buf_t)


class _BufferTree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.norm = nn.BatchNorm1d(3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.lin(x))
        for name, buf in self.named_buffers():
            if buf.dtype == torch.float64 and buf.dim() == 1 and name != "norm.running_var":
                y = y + buf[:3].sum()
        return y


def _buffer_tree_changes(rank, world_size):
    # Between forwards the module's buffers change in every way the per-forward
    # sync must notice: registered after wrapping, on the root and on a new
    # submodule; a buffer's memory swapped under the same tensor object; a
    # buffer resized in place; a submodule replaced. Each rank changes them
    # differently; every forward must see rank 0's values, as with torch's DDP.
    torch.manual_seed(0)
    base = _BufferTree()
    out = {}
    for name, cls in IMPLS.items():
        model = copy.deepcopy(base)
        ddp = cls(model)
        seen = []
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        for step in range(6):
            mine = float((rank + 1) * (step + 1))
            if step == 1:
                model.register_buffer("late", torch.full((3,), mine, dtype=torch.float64))
            elif step == 2:
                model.extra = nn.Module()
                model.extra.register_buffer("deep", torch.full((4,), mine, dtype=torch.float64))
            elif step == 3:
                model.late.data = torch.full((3,), mine, dtype=torch.float64)
            elif step == 4:
                model.extra.deep.resize_(5).fill_(mine)
            elif step == 5:
                model.norm = nn.BatchNorm1d(3).double()
                model.norm.running_mean.fill_(mine)
            y = ddp(x)
            seen.append([b.clone() for b in model.buffers()] + [y.detach().clone()])
            y.sum().backward()
        out[name] = seen
    return out


def test_buffer_changes_between_forwards_are_synced_like_torch(pools):
    for r in pools.run(2, _buffer_tree_changes):
        for mine, theirs in zip(r["gradring"], r["torch"], strict=True):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert a.shape == b.shape and torch.equal(a, b)
