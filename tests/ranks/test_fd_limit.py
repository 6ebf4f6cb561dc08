"""Open files do not grow with the buckets (see [Note: a mapping holds no descriptor]
in comm/transports/shm/segments.py), and a process limit hit all the same falls back
to the process group with one warning line that names it.

Both run in the pooled ranks under a lowered ``RLIMIT_NOFILE`` (restored after),
against torch's DDP and torch's all_reduce on gloo as the oracles."""

from __future__ import annotations

import contextlib
import io
import os
import resource

import torch
import torch.distributed as dist
from torch import nn

import gradring
from gradring import comm

N_PARAMS = 200
#: 400 float32 = 1,600 bytes per parameter, above the cap: one bucket each after the
#: rebuild.
CAP_MB = 0.001


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _nofile(soft: int):
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)


class Many(nn.Module):
    """``N_PARAMS`` parameters of 400 elements, each used once."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(400) * 0.1)
                                    for _ in range(N_PARAMS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(((x * (k + 1)) * p).sum() for k, p in enumerate(self.ps))


def _train(rank: int, impl: type, group: object) -> tuple[list[list[torch.Tensor]], int]:
    torch.manual_seed(0)
    model = impl(Many(), bucket_cap_mb=CAP_MB, process_group=group)
    grads = []
    for step in range(3):
        x = torch.randn(400, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad(set_to_none=True)
        model(x).backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
    buckets = len(model.reducer.buckets) if impl is gradring.DistributedDataParallel else 0
    return grads, buckets


def _many_buckets_under_low_limit(rank: int, world_size: int) -> dict:
    group = dist.new_group(backend="gloo")
    try:
        before = _open_files()
        # Far fewer open files than buckets: each bucket holding one failed here.
        with _nofile(before + 24):
            theirs, _ = _train(rank, torch.nn.parallel.DistributedDataParallel, group)
            ours, buckets = _train(rank, gradring.DistributedDataParallel, group)
            after = _open_files()
        return {"ours": ours, "theirs": theirs, "buckets": buckets, "before": before,
                "after": after}
    finally:
        comm.barrier(group=group)
        dist.destroy_process_group(group)


def test_two_hundred_buckets_train_under_a_low_open_file_limit(pools):
    for r in pools.run(2, _many_buckets_under_low_limit, timeout=240):
        assert r["buckets"] == N_PARAMS
        # The transport's own descriptors (the group lock), not one per bucket.
        assert r["after"] - r["before"] <= 4, (r["before"], r["after"])
        for step, (a, b) in enumerate(zip(r["ours"], r["theirs"])):
            for k, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (step, k)


def _limit_hit(rank: int, world_size: int) -> dict:
    from gradring.comm.transports.shm import space

    group = dist.new_group(backend="gloo")
    held: list[int] = []
    err = io.StringIO()
    x = torch.arange(70_000, dtype=torch.float32) * (rank + 1) + 0.25
    mine = x.clone()
    try:
        comm.all_reduce(torch.ones(2), group=group)  # connects shm (inline: no staging)
        space._warned.clear()  # this pooled process may have warned in another test
        # Rank 1 alone reaches its limit; rank 0 is told it was a limit, not /dev/shm.
        with _nofile(_open_files() + 8), contextlib.redirect_stderr(err):
            with contextlib.suppress(OSError):  # take every descriptor left
                while rank == 1:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            empty = comm.empty(1000, group=group)
            shared = comm.in_transport_memory(empty, group=group)
            comm.all_reduce(mine, group=group)  # its staging cannot be made
            for fd in held:
                os.close(fd)
            held = []
        again = x * 3
        comm.all_reduce(again, group=group)  # the group goes on, over the process group
        dist.all_reduce(x, group=group)
        return {"shared": shared, "ours": mine, "again": again, "torch": x,
                "stderr": err.getvalue()}
    finally:
        for fd in held:
            os.close(fd)
        comm.barrier(group=group)
        dist.destroy_process_group(group)


def test_open_file_limit_falls_back_with_one_line(pools):
    results = pools.run(2, _limit_hit, timeout=120)
    for rank, r in enumerate(results):
        assert r["shared"] is (rank == 0)
        assert torch.equal(r["ours"], r["torch"])
        assert torch.equal(r["again"], r["torch"] * 3)
        lines = [ln for ln in r["stderr"].splitlines() if "gradring warning" in ln]
        assert len(lines) == 1, r["stderr"]
        if rank == 1:
            assert "RLIMIT_NOFILE" in lines[0] and "open files" in lines[0], lines[0]
        else:
            assert "rank(s) [1] reached a process limit" in lines[0], lines[0]
            assert "process group" in lines[0], lines[0]
