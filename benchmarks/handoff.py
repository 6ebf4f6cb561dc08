"""The hand-off floor: what it costs two processes to tell each other "I am here".

    python benchmarks/handoff.py                 # world 2: 8-byte all-reduces, then the floor
    python benchmarks/handoff.py --reps 9 --iters 500

An all-reduce of a few bytes moves almost no data; its time is the
synchronisation between the ranks. The least any intra-host transport can
pay for that is one hand-off in each direction through shared memory. This
benchmark times exactly that, with no collective around it, between ranks 0
and 1 of the default process group, two ways:

- ``spin``: each side busy-reads the peer's word until it moves (the cost
  when both processes are running on their own cores: cache-line transfer
  plus the interpreter);
- ``block``: each side sleeps in ``FUTEX_WAIT`` until the peer's
  ``FUTEX_WAKE`` (the cost when the waiter is asleep: a kernel wake-up and
  a reschedule).

It first prints ``gradring bench allreduce``'s table at the same small sizes
(8 bytes unless ``--sizes`` says otherwise), then both floors, so that the gap
between gradring's small all-reduce and the floor is the transport's own
fixed cost (the Python on its path, its failure checks and phases), and what
is left is what no transport on this host can remove. Each floor is the
slowest rank's time per round trip, median over ``--reps`` repetitions of
``--iters`` round trips. The shared word lives in a file under /dev/shm that is
unlinked as soon as both ranks have mapped it.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm.transports.shm import futex
from gradring.tools.bench import allreduce
from gradring.tools.bench.ranks import run_ranks


def round_trips(rank: int, iters: int, block: bool) -> float:
    """Seconds per round trip (rank 0 hands off to rank 1 and back), as this rank
    saw it; collective over the default group, where ranks above 1 only wait."""
    name = [f"/dev/shm/gradring-bench-handoff-{os.getpid()}" if rank == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    if rank == 0:
        fd = os.open(name[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, mmap.PAGESIZE)
        os.close(fd)
    dist.barrier()
    mm = None
    try:
        if rank < 2:
            fd = os.open(name[0], os.O_RDWR)
            try:
                mm = mmap.mmap(fd, mmap.PAGESIZE)
            finally:
                os.close(fd)
        dist.barrier()
    finally:
        if rank == 0:
            os.unlink(name[0])
    if mm is None:
        dist.barrier()
        return 0.0
    try:
        return _timed_loop(mm, rank, iters, block)
    finally:
        mm.close()  # _timed_loop's views of it are gone with its frame
        dist.barrier()


def _timed_loop(mm: mmap.mmap, rank: int, iters: int, block: bool) -> float:
    mine, theirs = (ctypes.c_uint32.from_buffer(mm, 64 * k) for k in (rank, 1 - rank))
    addr, peer_addr = ctypes.addressof(mine), ctypes.addressof(theirs)

    def await_peer(target: int) -> None:
        if block:
            while (seen := theirs.value) < target:
                futex.wait(peer_addr, seen, 1.0)
        else:
            while theirs.value < target:
                pass

    def one(i: int) -> None:
        if rank == 0:
            futex.add_and_wake(addr)
            await_peer(i + 1)
        else:
            await_peer(i + 1)
            futex.add_and_wake(addr)

    for i in range(10):  # warm-up: both sides in the loop
        one(i)
    t0 = time.perf_counter()
    for i in range(10, 10 + iters):
        one(i)
    return (time.perf_counter() - t0) / iters


def _rank_main(rank: int, nproc: int, store_path: str, reps: int, iters: int,
               queue: Any) -> None:
    """One rank: ``reps`` x (spinning, then sleeping) round trips; rank 0 puts the
    slowest rank's seconds per round trip, per way, on ``queue``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=120))
    times: dict[str, list[float]] = {"spin": [], "block": []}
    for _ in range(reps):
        for how in times:
            times[how].append(round_trips(rank, iters, how == "block"))
    mat = torch.tensor([times[how] for how in times], dtype=torch.float64)
    dist.all_reduce(mat, op=dist.ReduceOp.MAX)  # ranks above 1 report 0
    if rank == 0:
        queue.put({how: mat[i].tolist() for i, how in enumerate(times)})
    dist.destroy_process_group()


def floor(nproc: int = 2, reps: int = 7, iters: int = 200,
          timeout: float = 600) -> dict[str, float]:
    """Seconds per round trip between ranks 0 and 1, ``spin`` and ``block``: the
    slowest rank's, median over ``reps`` repetitions, on ``nproc`` fresh ranks."""
    if nproc < 2:
        raise ValueError(f"the hand-off needs ranks 0 and 1: nproc must be at least 2, "
                         f"got {nproc}")
    res = run_ranks(_rank_main, nproc, (reps, iters), timeout=timeout)[0]
    return {how: statistics.median(v) for how, v in res.items()}


def floor_lines(floors: dict[str, float]) -> list[str]:
    """The floors as lines under the all-reduce table."""
    return [f"# hand-off floor ({how}): {t * 1e6:.1f} us per round trip between ranks "
            "0 and 1, no data" for how, t in floors.items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/handoff.py", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="rank processes (default: 2)")
    ap.add_argument("--sizes", default="8",
                    help="all-reduce sizes in bytes, comma-separated, K/M/G allowed "
                         "(default: 8)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions (default: 7)")
    ap.add_argument("--iters", type=int, default=200,
                    help="round trips per repetition (default: 200)")
    a = ap.parse_args(argv)
    if a.nproc < 2:
        ap.error(f"--nproc must be at least 2 (the hand-off needs ranks 0 and 1), "
                 f"got {a.nproc}")
    if a.reps < 1 or a.iters < 1:
        ap.error(f"--reps and --iters must be at least 1, got {a.reps} and {a.iters}")
    sizes = tuple(allreduce.parse_size(s) for s in a.sizes.split(","))
    table = allreduce.format_table(allreduce.run(a.nproc, sizes, a.reps))
    print("\n".join([table, *floor_lines(floor(a.nproc, a.reps, a.iters))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
