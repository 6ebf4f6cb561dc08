"""The hand-off floor: what it costs two processes to tell each other "I am here".

An all-reduce of a few bytes moves almost no data; its time is the
synchronisation between the ranks. The least any intra-host transport can
pay for that is one hand-off in each direction through shared memory. This
module times exactly that, with no collective around it, between ranks 0
and 1 of the default process group, two ways:

- ``spin``: each side busy-reads the peer's word until it moves (the cost
  when both processes are running on their own cores: cache-line transfer
  plus the interpreter);
- ``block``: each side sleeps in ``FUTEX_WAIT`` until the peer's
  ``FUTEX_WAKE`` (the cost when the waiter is asleep: a kernel wake-up and
  a reschedule).

``gradring bench allreduce --handoff`` prints both beside the 8-byte
all-reduces, so that the gap between gradring's small all-reduce and this
floor is the transport's own fixed cost (the Python on its path, its
failure checks and phases), and what is left is what no transport on this
host can remove. The shared word lives in a file under /dev/shm that is
unlinked as soon as both ranks have mapped it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import torch.distributed as dist

from gradring.comm.transports.shm import futex


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
