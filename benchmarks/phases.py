"""Which phase of a training step a DDP's overhead sits in: zero_grad, forward,
backward (with the reduction at its end) or the optimizer step.

    python benchmarks/phases.py                          # small2000, world 2
    python benchmarks/phases.py --model resnet --steps 120

Each rank steps the plain model (``pair``), torch's DDP and gradring's DDP in
turn, in an order shuffled each step (the same on every rank), every step
started by a barrier, and times each phase of each step. The table gives,
per rank and phase, the median over steps of each set-up, and each DDP minus
the pair. The backward's figure includes the wait for the other rank at the
reduction (the ranks' backwards end apart), which any DDP pays; the
optimizer step is cheaper under a reducer that read every ``.grad`` before
it (the first read of a tensor autograd made wraps it for Python, once).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PHASES = ("zero_grad", "forward", "backward", "step")


def _phases(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> list[float]:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    loss = model(x).float().pow(2).mean()
    t2 = time.perf_counter()
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    return [(b - a) * 1e3 for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]


def _rank(rank: int, world: int, model_name: str, steps: int, warm: int
          ) -> dict[str, list[list[float]]]:
    import gradring
    from gradring.tools.bench.ddp_step import MODELS, build

    torch.set_num_threads(1)
    kind, batch = MODELS[model_name]
    base, make_x = build(kind)
    x = make_x(batch)
    setups: dict[str, nn.Module] = {
        "pair": copy.deepcopy(base),
        "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
        "gradring": gradring.DistributedDataParallel(copy.deepcopy(base)),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in setups.items()}
    out: dict[str, list[list[float]]] = {k: [] for k in setups}
    keys = list(setups)
    for step in range(warm + steps):
        random.Random(step).shuffle(keys)
        for key in keys:
            dist.barrier()
            times = _phases(setups[key], opts[key], x)
            if step >= warm:
                out[key].append(times)
    return out


def table(results: list[dict[str, list[list[float]]]]) -> list[str]:
    """Per rank and phase: each set-up's median ms, and each DDP minus the pair."""
    lines = [f"{'rank':>4}  {'phase':<10}{'pair':>9}{'torch':>9}{'gradring':>10}"
             f"{'torch-pair':>12}{'gradring-pair':>15}"]
    for rank, res in enumerate(results):
        med = {k: [statistics.median(s[i] for s in steps) for i in range(len(PHASES))]
               for k, steps in res.items()}
        med = {k: v + [sum(v)] for k, v in med.items()}
        for i, phase in enumerate((*PHASES, "sum")):
            p, t, g = med["pair"][i], med["torch"][i], med["gradring"][i]
            lines.append(f"{rank:>4}  {phase:<10}{p:9.2f}{t:9.2f}{g:10.2f}"
                         f"{t - p:12.2f}{g - p:15.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.bench.ddp_step import MODELS

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small2000")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warm", type=int, default=10)
    a = ap.parse_args(argv)
    from gradring.tools.launch import run_local

    results: list[Any] = run_local(_rank, a.nproc, a.model, a.steps, a.warm)
    print(f"{a.model}, world {a.nproc}, {a.steps} steps each (after {a.warm} warm-up), "
          "median ms per phase")
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
