"""All-reduce benchmark, nccl-tests style: gradring against gloo, side by side in one run.

    gradring bench allreduce                        # world 2, ~25 s
    gradring bench allreduce --nproc 4 --sizes 4,1M,25M --reps 7
    gradring bench allreduce --variants shm-empty,gloo

It starts ``--nproc`` rank processes itself (gloo process group over a
FileStore, one intra-op thread each), and for every size times, in
interleaved order and ``--reps`` times over:

- ``gradring-shm (comm.empty)``: a tensor from ``comm.empty`` (zero-copy);
- ``gradring-shm (user tensor)``: an ordinary tensor (staged through shm);
- ``gradring ring (gloo p2p)``: gradring's ring over gloo send/recv;
- ``gloo native``: ``torch.distributed.all_reduce``.

A time is the slowest rank's mean over a batch of back-to-back calls; the
table shows medians over repetitions. algbw = size / time and busbw = algbw ×
2(N-1)/N, as nccl-tests define them. The *memory-traffic bound* is the time
of the least memory traffic an intra-host all-reduce needs: every rank must at
least read the W copies of its 1/W chunk and write the sum ((W+1)/W · size
bytes at the measured in-place-add bandwidth) and copy the W-1 other reduced
chunks (2(W-1)/W · size bytes at the measured copy bandwidth); both bandwidths
are measured in the same run, on all ranks at once, with the kernels the
collectives use (``add_``, ``copy_``) on ordinary memory. Each kernel is timed
alone, so an algorithm can come in slightly under it (above 100%) by reusing
cache lines between phases: the two-shot writes each sum into lines it has
just read. Call :func:`run` and :func:`format_table` from code.

A source checkout's ``benchmarks/`` holds developer studies built on this
one: ``allreduce_crossover.py`` (the algorithms behind the
size thresholds) and ``handoff.py`` (a bare futex hand-off between ranks, the
floor under a small all-reduce).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, NamedTuple

from gradring.tools.bench.ranks import run_ranks

VARIANTS = {
    "shm-empty": "gradring-shm (comm.empty)",
    "shm-user": "gradring-shm (user tensor)",
    "ring-gloo": "gradring ring (gloo p2p)",
    "gloo": "gloo native",
}
DEFAULT_SIZES = (4, 64 * 1024, 1 << 20, 4 << 20, 25 << 20)


class Row(NamedTuple):
    size: int  # bytes
    variant: str  # key of VARIANTS
    time_s: float  # median over repetitions of the slowest rank's per-call time
    algbw: float  # GB/s
    busbw: float  # GB/s


class Bound(NamedTuple):
    size: int
    add_gbs: float  # in-place add, bytes read+written per second (3 per element)
    copy_gbs: float  # copy, bytes read+written per second (2 per element)
    time_s: float  # lower bound on an all-reduce of ``size`` bytes
    busbw: float


class Result(NamedTuple):
    nproc: int
    reps: int
    rows: list[Row]
    bounds: list[Bound]


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _iters(size: int) -> int:
    """Calls per timed batch: ~64 MiB of payload, at least 3, at most 200."""
    return max(3, min(200, (64 << 20) // max(size, 1)))


def _rank_main(rank: int, nproc: int, store_path: str, sizes: list[int], reps: int,
               variants: list[str], queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from gradring import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, nproc), rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=120))
    env = {"shm-empty": ("shm", ""), "shm-user": ("shm", ""), "ring-gloo": ("torch", "ring")}

    def set_env(variant: str) -> None:
        transport, algo = env.get(variant, ("", ""))
        for key, value in (("GRADRING_TRANSPORT", transport), ("GRADRING_ALGO", algo)):
            if value:
                os.environ[key] = value
            else:
                os.environ.pop(key, None)

    # Correctness first: a benchmark of a wrong answer is worthless.
    for variant in variants:
        set_env(variant)
        x = comm.empty(1000) if variant == "shm-empty" else torch.empty(1000)
        x.fill_(rank + 1)
        (dist.all_reduce if variant == "gloo" else comm.all_reduce)(x)
        assert torch.all(x == nproc * (nproc + 1) / 2), f"{variant} gave a wrong sum"

    times: dict[tuple[int, str], list[float]] = {}
    rates: dict[int, list[tuple[float, float]]] = {}
    for size in sizes:
        n = max(1, size // 4)
        tensors = {v: (comm.empty(n) if v == "shm-empty" else torch.empty(n)).zero_()
                   for v in variants}
        iters = _iters(size)
        chunk = max(1, n // nproc)
        a, b = torch.zeros(chunk), torch.zeros(chunk)
        for _ in range(reps):
            for variant in variants:
                set_env(variant)
                t = tensors[variant]
                call = dist.all_reduce if variant == "gloo" else comm.all_reduce
                call(t)  # warm both staging sets: page faults stay outside the timing
                call(t)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call(t)
                times.setdefault((size, variant), []).append((time.perf_counter() - t0) / iters)
            if size >= 1 << 20:  # memory bandwidth, all ranks at once
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    a.add_(b)
                t_add = (time.perf_counter() - t0) / iters
                t0 = time.perf_counter()
                for _ in range(iters):
                    b.copy_(a)
                t_copy = (time.perf_counter() - t0) / iters
                rates.setdefault(size, []).append((3 * chunk * 4 / t_add, 2 * chunk * 4 / t_copy))
        del tensors
    set_env("gloo")
    # The slowest rank defines a collective's time; slowest bandwidth the bound.
    keys = sorted(times)
    mat = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(mat, op=dist.ReduceOp.MAX)
    rkeys = sorted(rates)
    rmat = torch.tensor([rates[k] for k in rkeys], dtype=torch.float64).reshape(-1, reps, 2)
    dist.all_reduce(rmat, op=dist.ReduceOp.MIN)
    if rank == 0:
        queue.put(({k: mat[i].tolist() for i, k in enumerate(keys)},
                   {k: rmat[i].tolist() for i, k in enumerate(rkeys)}))
    comm.shutdown()
    dist.destroy_process_group()


def run(nproc: int = 2, sizes: tuple[int, ...] = DEFAULT_SIZES, reps: int = 7,
        variants: tuple[str, ...] = tuple(VARIANTS), timeout: float = 600) -> Result:
    """Run the benchmark in ``nproc`` fresh processes; return medians."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    times, rates = run_ranks(_rank_main, nproc, (list(sizes), reps, list(variants)),
                             timeout=timeout)[0]
    busfactor = 2 * (nproc - 1) / nproc
    rows = []
    for (size, variant), samples in sorted(times.items(), key=lambda kv: (
            kv[0][0], list(VARIANTS).index(kv[0][1]))):
        t = statistics.median(samples)
        rows.append(Row(size, variant, t, size / t / 1e9, size / t / 1e9 * busfactor))
    bounds = []
    for size, samples in sorted(rates.items()):
        add = statistics.median(s[0] for s in samples)
        cpy = statistics.median(s[1] for s in samples)
        w = nproc
        t = (w + 1) / w * size / add + 2 * (w - 1) / w * size / cpy
        bounds.append(Bound(size, add / 1e9, cpy / 1e9, t, size / t / 1e9 * busfactor))
    return Result(nproc, reps, rows, bounds)


def fmt_size(size: int) -> str:
    """``size`` bytes as the table writes it: 4 B, 64 KiB, 25 MiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def format_table(res: Result) -> str:
    """The result as an nccl-tests-like table, with ratios against gloo."""
    gloo = {r.size: r.time_s for r in res.rows if r.variant == "gloo"}
    lines = [f"# all_reduce float32 SUM, world {res.nproc}, median of {res.reps} reps "
             f"(cpus: {os.cpu_count()})",
             f"# {'size':>9}  {'variant':<28} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'vs gloo':>8}"]
    for r in res.rows:
        ratio = f"{gloo[r.size] / r.time_s:7.2f}x" if r.size in gloo else ""
        lines.append(f"  {fmt_size(r.size):>9}  {VARIANTS[r.variant]:<28} "
                     f"{r.time_s * 1e6:10.1f} {r.algbw:12.3f} {r.busbw:12.3f} {ratio:>8}")
    for b in res.bounds:
        best = [r for r in res.rows if r.size == b.size and r.variant == "shm-empty"]
        reach = f"; comm.empty reaches {best[0].busbw / b.busbw:.0%}" if best else ""
        lines.append(f"# memory-traffic bound at {fmt_size(b.size)}: busbw {b.busbw:.2f} GB/s "
                     f"({b.time_s * 1e6:.0f} us; add {b.add_gbs:.1f} GB/s, copy "
                     f"{b.copy_gbs:.1f} GB/s){reach}")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog or "gradring bench allreduce",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="rank processes (default: 2)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                        help="comma-separated byte sizes, suffixes K/M/G allowed "
                             "(default: %(default)s)")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (default: 7)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    args = parser.parse_args(argv)
    res = run(args.nproc, tuple(parse_size(s) for s in args.sizes.split(",")), args.reps,
              tuple(v.strip() for v in args.variants.split(",")))
    print(format_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
