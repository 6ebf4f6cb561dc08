"""What each DDP costs in memory and page faults, every set-up in processes of its own.

    python benchmarks/view_memory.py                       # mlp64 and mlp8, world 2
    python benchmarks/view_memory.py --models mlp64 --rounds 5 --steps 12

``gradring bench ddp`` steps every set-up in one process, so they share one
allocator: what one set-up frees, the next may reuse, and which of them
faults fresh pages in depends on its neighbours. Here each set-up (the plain
model, torch's DDP and gradring's, each with and without
gradient_as_bucket_view) runs as its own world-2 job, one after another,
round after round, as a user's one model per process does. Per step
(``zero_grad(set_to_none=True)``, forward, backward, SGD step) each rank
counts its minor page faults (``getrusage``) and times the step, and sums,
after each gradient's accumulation (a post-accumulate hook on every
parameter, the same on every set-up), the bytes of the ``.grad`` tensors
that are not views of a bucket: the most during a backward is what new
gradients cost beside the buckets at their peak (resident memory would not
show it: the allocator keeps what is freed for the next allocation). The table gives,
per set-up, the median over rounds of rank 0's median faults and
milliseconds per step and of that peak, with the range across rounds.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from typing import Any

SETUPS = ("plain", "torch", "torch_view", "gradring", "gradring_view")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rank(rank: int, world: int, model_name: str, setup: str, steps: int, warm: int
          ) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import gradring
    from gradring.tools.bench.ddp_step import MODELS, build

    torch.set_num_threads(1)
    kind, batch = MODELS[model_name]
    base, make_x = build(kind)
    x = make_x(batch)
    view = setup.endswith("_view")
    if setup == "plain":
        model = base
    elif setup.startswith("torch"):
        model = torch.nn.parallel.DistributedDataParallel(base, gradient_as_bucket_view=view)
    else:
        model = gradring.DistributedDataParallel(base, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    # The gradients alive outside any bucket (a .grad that is not a view:
    # bucket slots are views of their bucket's flat buffer), after each
    # gradient's accumulation (a post-accumulate hook on every parameter,
    # the same on every set-up): the most, over the measured steps.
    params = list(base.parameters())
    seen = [0]

    def held(_p: torch.Tensor) -> None:
        total = sum(q.grad.untyped_storage().nbytes() for q in params
                    if q.grad is not None and q.grad._base is None)
        seen[0] = max(seen[0], total)

    for p in params:
        p.register_post_accumulate_grad_hook(held)
    faults, times = [], []
    for step in range(warm + steps):
        dist.barrier()
        f0, t0 = _faults(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()
        t1, f1 = time.perf_counter(), _faults()
        if step + 1 == warm:
            seen[0] = 0
        if step >= warm:
            faults.append(f1 - f0)
            times.append((t1 - t0) * 1e3)
    return {"faults": statistics.median(faults), "ms": statistics.median(times),
            "peak_mib": seen[0] / 2**20}


def _cell(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    return f"{med:{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.launch import run_local

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mlp64", "mlp8"])
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm", type=int, default=4)
    a = ap.parse_args(argv)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(a.rounds):
        for model in a.models:
            for setup in a.setups:
                res = run_local(_rank, 2, model, setup, a.steps, a.warm)
                rows.setdefault((model, setup), []).append(res[0])
    print(f"world 2, {a.rounds} rounds of {a.steps} steps (after {a.warm}), each set-up in "
          "its own processes; rank 0, median over rounds [range]")
    print(f"{'model':<8}{'set-up':<15}{'faults/step':>22}{'ms/step':>26}"
          f"{'outside buckets MiB':>26}")
    for (model, setup), res in rows.items():
        print(f"{model:<8}{setup:<15}"
              f"{_cell([r['faults'] for r in res], '.0f'):>22}"
              f"{_cell([r['ms'] for r in res], '.1f'):>26}"
              f"{_cell([r['peak_mib'] for r in res], '.1f'):>26}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
