"""What always-on tracing costs, as a fraction of a DDP step.

    python benchmarks/trace_cost.py

Two measurements, side by side in one run on 2 local ranks:
1. marks per iteration (read from the trace) x the cost of one mark (timed in
   a tight loop on this rank) / the median step time;
2. the median step time with tracing on and with the reducer's trace replaced
   by a no-op, interleaved round by round (noisy on a shared machine; the
   first figure is the one to quote).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn


class _NoTrace:
    iteration = 0

    def mark(self, *args: Any, **kwargs: Any) -> None:
        return None


def _rank(rank: int, world: int, rounds: int, steps: int) -> dict[str, float]:
    import gradring
    from gradring.observe.trace import Trace

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    ddp = gradring.DistributedDataParallel(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(32, 512)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
        return (time.perf_counter() - t0) / n

    run(3)
    real = ddp.reducer.trace
    it = real.iteration - 1
    marks = len(real.iteration_events(it))
    on, off = [], []
    for _ in range(rounds):
        ddp.reducer.trace = real
        on.append(run(steps))
        ddp.reducer.trace = _NoTrace()
        off.append(run(steps))
    ddp.reducer.trace = real
    probe = Trace()
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        probe.mark("ready", 3)
    per_mark = (time.perf_counter() - t0) / n
    step = statistics.median(on)
    return {"marks": marks, "per_mark_us": per_mark * 1e6, "step_ms": step * 1e3,
            "fraction": marks * per_mark / step, "off_ms": statistics.median(off) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    from gradring.tools.launch import run_local

    r = run_local(_rank, a.nproc, a.rounds, a.steps)[0]
    print(f"marks/iteration {r['marks']}, one mark {r['per_mark_us']:.2f} us, "
          f"step {r['step_ms']:.2f} ms -> tracing costs {r['fraction']:.4%} of a step")
    print(f"step with tracing {r['step_ms']:.2f} ms, without {r['off_ms']:.2f} ms "
          f"(ratio {r['step_ms'] / r['off_ms']:.3f}; noise on a shared machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
