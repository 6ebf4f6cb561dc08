"""Where the microseconds of a small synchronous all-reduce go, part by part.

World 2 on one host (two fresh processes over gloo's store). Each rank runs
``--calls`` 8-byte ``gradring.comm.all_reduce`` calls per round; on rank 0
the parts of the path are wrapped with a timer, and the table gives each
part's median per call over ``--rounds`` rounds, and the whole call's:

- ``api + checks``: ``comm.all_reduce`` and ``runner.small_all_reduce`` (group lookup,
  the eligibility checks, the engine's ``run_now``), less the recorder entry;
- ``recorder entry``: the sequence number and the flight-recorder entry;
- ``transport.start``: the deadline, the verdict, the fingerprint, the status block;
- ``copy in + descriptor``: the input into the inline slot, the descriptor;
- ``arrive``: the group lock, the barrier word, the wake-up;
- ``wait for the peer``: the barrier wait (spin, yield, sleep);
- ``check descriptors``: the peers' descriptors against this rank's;
- ``reduce + finish``: the sum in rank order, AVG's division;
- ``the rest``: the whole call minus the parts (glue, the timers themselves).

Each timer adds about 0.2 us to its part. Run it on a quiet machine:

    python benchmarks/small_path_profile.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gradring.tools.bench.ranks import run_ranks


def _timed(acc: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += clock() - t0
    return wrapper


def _busy(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def _rank_main(rank: int, nproc: int, store: str, calls: int, nrounds: int,
               busy_us: float, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from gradring import comm
    from gradring.comm import context as comm_context
    from gradring.comm import recorder, runner
    from gradring.comm.transports.shm import transport as shm_transport

    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    x = torch.ones(2)
    for _ in range(200):
        comm.all_reduce(x)
    ctx = comm_context.existing_context(None)
    assert ctx is not None and ctx.small is not None
    t = ctx.transports.existing_shm()
    acc: dict[str, float] = defaultdict(float)
    if rank == 0:
        # Wrap the parts (instance attributes shadow the methods, so the path's own
        # calls go through the timers).
        rec = recorder.RECORDER
        rec.issue = _timed(acc, "recorder entry", rec.issue)
        t.start = _timed(acc, "transport.start", t.start)
        t.arrive = _timed(acc, "arrive", t.arrive)
        t.wait_arrivals = _timed(acc, "wait for the peer", t.wait_arrivals)
        real_exchange = shm_transport.ShmTransport.exchange_inline
        t.exchange_inline = _timed(acc, "_exchange", lambda *a: real_exchange(t, *a))
        import gradring.comm.algos.direct as direct
        real_reduce, real_finish = direct.ops.reduce_into, direct.ops.finish
        direct.ops.reduce_into = _timed(acc, "reduce + finish", real_reduce)
        direct.ops.finish = _timed(acc, "reduce + finish", real_finish)
        real_run = runner.run_small_all_reduce
        runner.run_small_all_reduce = _timed(acc, "_run", real_run)
    rounds: dict[str, list[float]] = defaultdict(list)
    for _ in range(nrounds):
        acc.clear()
        elapsed = 0
        if busy_us > 0:  # a training step's compute before each call
            for _ in range(calls):
                _busy(busy_us)
                t0 = time.perf_counter_ns()
                comm.all_reduce(x)
                elapsed += time.perf_counter_ns() - t0
        else:
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                comm.all_reduce(x)
            elapsed = time.perf_counter_ns() - t0
        total = elapsed / calls / 1000
        if rank == 0:
            per = {k: v / calls / 1000 for k, v in acc.items()}
            # Parts that contain others: report what is theirs alone.
            exchange = per.pop("_exchange", 0.0)
            run = per.pop("_run", 0.0)
            inner = per.get("arrive", 0) + per.get("wait for the peer", 0)
            # exchange_inline = copy in + descriptor + arrive + wait + check descriptors;
            # the copy and the check are not separable without editing the method, so
            # they are reported together.
            per["copy in + descriptor + check descriptors"] = exchange - inner
            per["api + checks"] = total - run - per.get("engine enter/leave", 0) \
                - per.get("recorder entry", 0)
            known = sum(v for k, v in per.items() if k != "api + checks")
            per["the rest (runner glue, timers)"] = run - (known - per.get(
                "engine enter/leave", 0) - per.get("recorder entry", 0))
            per["whole call"] = total
            for k, v in per.items():
                rounds[k].append(v)
    if rank == 0:
        queue.put(dict(rounds))
    comm.shutdown()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds")
    p.add_argument("--busy-us", type=float, default=0.0,
                   help="busy work before each call (a training step's compute), not timed")
    args = p.parse_args(argv)
    rounds = run_ranks(_rank_main, 2, (args.calls, args.rounds, args.busy_us),
                       timeout=900)[0]
    print("8-byte all_reduce, world 2, rank 0: us per call, median over rounds [min-max]")
    for k, v in rounds.items():
        print(f"  {k:42s} {statistics.median(v):7.1f} [{min(v):.1f}-{max(v):.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
