"""The developer benchmarks' rank pieces: the floor DDP (``benchmarks/ddp_floor.py``)
must be a DDP, with torch's DDP on the same model and batches as its oracle, and
the hand-off floor (``benchmarks/handoff.py``) must complete both ways and clean up.
(Their tables are checked in tests/unit/test_dev_benchmarks.py.)"""

from __future__ import annotations

import torch
from torch import nn


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _floor_against_torch(rank: int, world_size: int) -> dict:
    from benchmarks.ddp_floor import FlatDDP

    torch.set_num_threads(1)
    mine = FlatDDP(_cnn())
    ref = nn.parallel.DistributedDataParallel(_cnn())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (mine, ref)]
    grads_same, bufs_same = [], []
    for step in range(4):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(4, 3, 8, 8)
        for m, o in zip((mine, ref), opts):
            o.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
        grads_same.append(all(torch.equal(a.grad, b.grad)
                              for a, b in zip(mine.parameters(), ref.parameters())))
        bufs_same.append(all(torch.equal(a, b) for a, b in zip(mine.buffers(), ref.buffers())))
        for o in opts:
            o.step()
    return {"grads": grads_same, "buffers": bufs_same}


def test_floor_ddp_gives_torch_ddp_gradients_and_buffers(pools) -> None:
    for r in pools.run(2, _floor_against_torch):
        assert all(r["grads"]), r
        assert all(r["buffers"]), r


def _handoffs(rank: int, world_size: int) -> dict:
    import glob

    from benchmarks.handoff import round_trips

    torch.set_num_threads(1)
    times = [round_trips(rank, 20, block) for block in (False, True)]
    return {"times": times, "left": glob.glob("/dev/shm/gradring-bench-handoff-*")}


def test_handoff_floor_runs_both_ways_and_leaves_no_file(pools) -> None:
    # ``benchmarks/handoff.py``: 20 round trips spinning, 20 sleeping in
    # the kernel; each side completes them (a lost wake-up would hang the rank), and
    # the shared word's file is gone once both ranks mapped it.
    for r in pools.run(2, _handoffs):
        assert all(t > 0 for t in r["times"]), r
        assert r["left"] == [], r
