"""A DDP step's bucket collectives against the same all-reduce on hot and on cold
data: how far the rung's denominator is from what a step can get.

    python benchmarks/step_collectives.py                       # mlp64, world 2
    python benchmarks/step_collectives.py --models mlp64 resnet --rounds 3
    GRADRING_FAST_PATHS=-homed python benchmarks/step_collectives.py

``benchmarks/ddp_rung.py`` divides the DDP overhead by one all-reduce of the
model's gradient bytes, resident in shared memory and timed back to back, so
its data sits in the caches. A step's collectives never find it so. Per
model, rank 0 times:

- ``in the step``: each bucket's collective during training steps, as DDP
  issues it (with the fast path ``homed``, the all-reduce with external parts),
  from its launch until it is done: the launch waits for it, so that each
  collective runs alone (its CPU time is then the waiting thread's, not the
  comm thread's);
- ``hot``: a plain all-reduce of the same bucket buffer, back to back;
- ``cold``: the same, after writing 128 MiB elsewhere before each call;
- ``just written``: the same, after each rank rewrote its buffer in place
  (as a step's copy-in does: the peer then reads lines another core has
  just dirtied);
- ``comm.empty``: a fresh buffer of the same size, back to back (what the rung
  times).

Each figure is rank 0's own time per call, wall clock and CPU time
(``time.thread_time``), the median over ``--steps`` calls; every plain call
starts after a barrier. ``--rounds`` repeats it in fresh
processes, to show the spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from gradring.tools.bench.ranks import run_ranks

#: Bytes written before each "cold" call, to push the buffer out of the caches.
SCRATCH_BYTES = 128 * 2**20


def _median_ms(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return (statistics.median(w for w, _ in samples) * 1e3,
            statistics.median(c for _, c in samples) * 1e3)


def _rank_main(rank: int, nproc: int, store: str, model_name: str, steps: int,
               queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GRADRING_QUIET"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    from gradring import comm
    from gradring.tools.bench import ddp_step

    ddp, opt, x = ddp_step.gradring_ddp(model_name)
    for _ in range(6):  # warm-up and the rebuild
        ddp_step.train_step(ddp, opt, x)
    buckets = ddp.reducer.buckets
    calls: list[tuple[float, float]] = []
    launcher = ddp.reducer._launcher
    reduce = launcher.reduce  # a bucket's collective, as the launch issues it

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            fut = reduce(*args, **kwargs)
            fut.wait()  # alone: nothing else of the step runs meanwhile
            return fut
        finally:
            calls.append((time.perf_counter() - t0, time.thread_time() - c0))

    launcher.reduce = timed
    dist.barrier()
    for _ in range(steps):
        ddp_step.train_step(ddp, opt, x)
    launcher.reduce = reduce
    per_step = len(calls) // steps
    if per_step != len(buckets):
        raise RuntimeError(f"{len(calls)} collectives in {steps} steps for "
                           f"{len(buckets)} buckets: not one per bucket and step")
    scratch = torch.empty(SCRATCH_BYTES // 4)

    def plain(buf: torch.Tensor, cold: bool = False,
              written: bool = False) -> tuple[float, float]:
        samples = []
        for _ in range(steps):
            if cold:
                scratch.fill_(1.0)
            if written:
                buf.mul_(1.0)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            comm.all_reduce(buf)
            samples.append((time.perf_counter() - t0, time.thread_time() - c0))
        return _median_ms(samples)

    rows = []
    for i, b in enumerate(buckets):
        fresh = comm.empty(b.buffer.numel(), dtype=b.buffer.dtype).zero_()
        comm.all_reduce(fresh)  # map it and fault its pages in
        rows.append({"bytes": b.buffer.numel() * b.buffer.element_size(),
                     "in the step": _median_ms(calls[i::per_step]),
                     "hot": plain(b.buffer), "cold": plain(b.buffer, cold=True),
                     "just written": plain(b.buffer, written=True),
                     "comm.empty": plain(fresh)})
        del fresh
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


COLUMNS = ("in the step", "hot", "cold", "just written", "comm.empty")


def report(model: str, rounds: list[list[dict[str, Any]]]) -> str:
    """Per bucket and in all: each column's wall ms (median over rounds, [min-max])
    and CPU ms (median)."""
    lines = [f"{model}: ms per collective, rank 0, wall median over rounds [min-max] / CPU"]
    head = f"  {'bucket':<14}" + "".join(f"{c:>24}" for c in COLUMNS)
    lines.append(head)
    n = len(rounds[0])
    for i in range(n + 1):
        label = f"{i} ({rounds[0][i]['bytes'] / 2**20:.1f} MiB)" if i < n else "all"
        cells = []
        for c in COLUMNS:
            walls = [sum(r[k][c][0] for k in (range(n) if i == n else [i])) for r in rounds]
            cpus = [sum(r[k][c][1] for k in (range(n) if i == n else [i])) for r in rounds]
            cells.append(f"{statistics.median(walls):7.2f} [{min(walls):.2f}-{max(walls):.2f}]"
                         f" / {statistics.median(cpus):5.2f}")
        lines.append(f"  {label:<14}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.bench import ddp_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp64"], choices=list(ddp_step.MODELS))
    p.add_argument("--steps", type=int, default=10, help="steps, and calls per plain column")
    p.add_argument("--rounds", type=int, default=3, help="fresh jobs per model")
    a = p.parse_args(argv)
    for model in a.models:
        rounds = [run_ranks(_rank_main, 2, (model, a.steps), timeout=1800)[0]
                  for _ in range(a.rounds)]
        print(report(model, rounds), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
