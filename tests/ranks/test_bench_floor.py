"""The bench's floor DDP (``gradring bench ddp --floor``) must be a DDP: torch's
DDP on the same model and batches is its oracle, and its table must say what
the per-round figures say."""

from __future__ import annotations

import torch
from torch import nn

from gradring.tools.bench.ddp_step import report


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _floor_against_torch(rank: int, world_size: int) -> dict:
    from gradring.tools.bench.floor import FlatDDP

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


def test_floor_table_gives_per_round_medians() -> None:
    rounds = {"pair": [10.0, 10.0, 10.0], "torch": [20.0, 22.0, 18.0],
              "gradring": [14.0, 15.0, 13.0], "gradring_view": [14.0, 15.0, 13.0],
              "floor": [12.0, 12.0, 12.0], "_pair_rank0": [10.0, 10.0, 10.0]}
    text = report({"m": rounds}, 2)
    row = next(line for line in text.splitlines()[::-1] if line.startswith("m "))
    # overheads: floor 2, gradring 4 (median of 4, 5, 3), torch 10; gradring - floor 2
    assert row.split() == ["m", "2.00", "4.00", "0.20", "0.40", "2.00"], text
    assert "floor" not in report({"m": {k: v for k, v in rounds.items() if k != "floor"}}, 2)


def _handoffs(rank: int, world_size: int) -> dict:
    import glob

    from gradring.tools.bench.handoff import round_trips

    torch.set_num_threads(1)
    times = [round_trips(rank, 20, block) for block in (False, True)]
    return {"times": times, "left": glob.glob("/dev/shm/gradring-bench-handoff-*")}


def test_handoff_floor_runs_both_ways_and_leaves_no_file(pools) -> None:
    # ``gradring bench allreduce --handoff``: 20 round trips spinning, 20 sleeping in
    # the kernel; each side completes them (a lost wake-up would hang the rank), and
    # the shared word's file is gone once both ranks mapped it.
    for r in pools.run(2, _handoffs):
        assert all(t > 0 for t in r["times"]), r
        assert r["left"] == [], r
