"""Where the all-reduce should switch algorithms: each candidate behind the size
thresholds of ``gradring/comm/select.py``, timed at every size.

    python benchmarks/allreduce_crossover.py              # world 2
    python benchmarks/allreduce_crossover.py --nproc 4 --reps 5

On shared memory, one-shot (every rank reads all W buffers) against two-shot
(reduce-scatter then all-gather: least memory traffic); over torch's
point-to-point, the double binary tree against the ring. The one-shot/two-shot
switch is forced by moving ``select.ONESHOT_MAX_BYTES`` in the rank processes,
the torch candidates by ``GRADRING_TRANSPORT=torch`` and ``GRADRING_ALGO``.
Sizes up to the inline limit travel inline whatever the one-shot threshold
says, so their two shared-memory columns agree. A time is the slowest rank's
mean over a batch of back-to-back calls on ordinary tensors, median over
``--reps`` repetitions; docs/collectives.md quotes the crossovers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from gradring.tools.bench import allreduce
from gradring.tools.bench.ranks import run_ranks

CANDIDATES = ("oneshot", "twoshot", "tree", "ring")
DEFAULT_SIZES = (4, 4096, 65536, 262144, 1 << 20)


def _rank_main(rank: int, nproc: int, store_path: str, sizes: list[int], reps: int,
               queue: Any) -> None:
    """Time each candidate at every size; rank 0 puts the medians on ``queue``."""
    import torch
    import torch.distributed as dist

    from gradring import comm
    from gradring.comm import select

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=120))
    out: dict[tuple[int, str], list[float]] = {}
    for size in sizes:
        t = torch.zeros(max(1, size // 4))
        for name in CANDIDATES:
            if name in ("tree", "ring"):
                os.environ.update(GRADRING_TRANSPORT="torch", GRADRING_ALGO=name)
            else:
                os.environ.pop("GRADRING_TRANSPORT", None)
                os.environ.pop("GRADRING_ALGO", None)
                select.ONESHOT_MAX_BYTES = 1 << 60 if name == "oneshot" else -1
            iters = max(3, min(100, (1 << 20) // max(size, 1)))
            for _ in range(reps):
                comm.all_reduce(t)
                comm.all_reduce(t)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    comm.all_reduce(t)
                out.setdefault((size, name), []).append((time.perf_counter() - t0) / iters)
    keys = sorted(out)
    mat = torch.tensor([out[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(mat, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put({k: statistics.median(mat[i].tolist()) for i, k in enumerate(keys)})
    comm.shutdown()
    dist.destroy_process_group()


def crossover(nproc: int = 2, sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 7,
              timeout: float = 600) -> str:
    """Table of the candidates behind select.py's thresholds (median us per call)."""
    res = run_ranks(_rank_main, nproc, (list(sizes), reps), timeout=timeout)[0]
    lines = [f"# crossovers, world {nproc}: time per all_reduce (us), user tensors",
             f"# {'size':>9} " + " ".join(f"{n:>9}" for n in CANDIDATES)]
    for size in sizes:
        cells = " ".join(f"{res[(size, n)] * 1e6:9.1f}" for n in CANDIDATES)
        lines.append(f"  {allreduce.fmt_size(size):>9} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/allreduce_crossover.py",
                                 description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="rank processes (default: 2)")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated byte sizes, K/M/G allowed (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions (default: 7)")
    a = ap.parse_args(argv)
    if a.nproc < 2 or a.reps < 1:
        ap.error(f"--nproc must be at least 2 and --reps at least 1, got {a.nproc} and "
                 f"{a.reps}")
    sizes = tuple(allreduce.parse_size(s) for s in a.sizes.split(","))
    print(crossover(a.nproc, sizes, a.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
