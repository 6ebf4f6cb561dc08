"""An 8-byte all-reduce after other work: how much slower a call is when the work
before it has pushed the call's code and data out of the caches.

    python benchmarks/small_after_work.py --calls 300

World 2 on one host. Each rank times ``--calls`` calls of
``gradring.comm.all_reduce`` of one float, each after about 1 ms of one kind
of work (untimed), and prints the median per call for each kind, per rank:

- ``nothing``: back to back;
- ``clock loop``: a Python loop reading the clock;
- ``Python loop``: a Python loop summing integers (calibrated to ~1 ms);
- ``matmul``: 128 x 128 matrix products (calibrated to ~1 ms);
- ``memory stream``: ``add_`` over 8 MiB, which evicts most of the caches;
- ``sleep``: ``time.sleep(0.001)``, the core idle or lent to another process.

The ranks do the same work, so the peer is normally there when a call
arrives; a call that finds it late waits, which shows up as spread between
the two ranks' figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from gradring.tools.bench.ranks import run_ranks


def _calibrated(fn: Callable[[int], None], target_s: float = 0.001) -> int:
    """The count ``n`` for which ``fn(n)`` takes about ``target_s``."""
    n = 1
    while True:
        t0 = time.perf_counter()
        fn(n)
        if time.perf_counter() - t0 >= target_s:
            return n
        n = max(n + 1, int(n * 1.3))


def _rank_main(rank: int, nproc: int, store: str, calls: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from gradring import comm

    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    x = torch.ones(1)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    big = torch.empty(8 << 20, dtype=torch.uint8)
    for _ in range(200):
        comm.all_reduce(x)

    def clock_loop() -> None:
        end = time.perf_counter_ns() + 1_000_000
        while time.perf_counter_ns() < end:
            pass

    def py_loop(n: int) -> None:
        s = 0
        for i in range(n):
            s += i

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    def stream(n: int) -> None:
        for _ in range(n):
            big.add_(1)

    # Every rank calibrates alike, and the counts are agreed so the ranks' work matches.
    counts = torch.tensor([_calibrated(py_loop), _calibrated(matmuls), _calibrated(stream)])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    n_py, n_mm, n_stream = (int(c) for c in counts)
    kinds: dict[str, Callable[[], None] | None] = {
        "nothing": None,
        "clock loop": clock_loop,
        "Python loop": lambda: py_loop(n_py),
        "matmul": lambda: matmuls(n_mm),
        "memory stream": lambda: stream(n_stream),
        "sleep": lambda: time.sleep(0.001),
    }
    res: dict[str, float] = {}
    for name, before in kinds.items():
        times = []
        for _ in range(calls):
            if before is not None:
                before()
            t0 = time.perf_counter_ns()
            comm.all_reduce(x)
            times.append(time.perf_counter_ns() - t0)
        res[name] = statistics.median(times) / 1000
    queue.put((rank, res))
    comm.shutdown()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="calls per kind of work")
    a = p.parse_args(argv)
    out = dict(run_ranks(_rank_main, 2, (a.calls,), results=2, timeout=900))
    print("8-byte all_reduce after ~1 ms of work, median us per call")
    print(f"  {'work before each call':24s} {'rank 0':>8s} {'rank 1':>8s}")
    for name in out[0]:
        print(f"  {name:24s} {out[0][name]:8.1f} {out[1][name]:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
