"""What a reducer pays per parameter: Python hooks and the copy back into ``.grad``.

    python benchmarks/hook_cost.py              # 2,000 tensors of 64 floats, ~1 minute
    python benchmarks/hook_cost.py --params 500 --numel 256 --steps 200

One process, one intra-op thread, a process group of one (so gradring's
reducer runs its whole per-gradient path but communicates nothing). Every
set-up takes one step in turn, step after step, and each figure is the
median step time of a set-up minus the plain model's, divided by the number
of parameters:

- ``noop hooks``: a Python post-accumulate-grad hook per parameter that does
  nothing (what any reducer written in Python pays to be told a gradient is in);
- ``copy back``: after the backward, one ``torch.cat`` of every gradient into a
  flat buffer, one multiply, and one ``torch._foreach_copy_`` back into the
  ``.grad`` tensors (what keeping torch's non-view ``.grad`` costs at least);
- ``gradring``: gradring's DDP (its default path for these slots: see [Note:
  packed slots] in gradring/buckets/packing.py).

docs/collectives.md quotes it beside ``gradring bench ddp``'s per-parameter
figures for torch's DDP.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradring.tools.bench.ddp_step import _ManySmall  # the bench's small2000 model


def _noop(_i: int, _param: torch.Tensor) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=2000)
    ap.add_argument("--numel", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args(argv)

    import gradring

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1),
                                rank=0, world_size=1)
        try:
            base = _ManySmall(a.params, a.numel)
            x = torch.randn(4, a.numel)
            hooked = copy.deepcopy(base)
            for i, p in enumerate(hooked.parameters()):
                p.register_post_accumulate_grad_hook(functools.partial(_noop, i))
            copied = copy.deepcopy(base)
            params = list(copied.parameters())
            flat = torch.zeros(sum(p.numel() for p in params))
            views = list(flat.split([p.numel() for p in params]))

            def copy_back() -> None:
                grads: Any = [p.grad for p in params]
                torch.cat(grads, out=flat)
                flat.mul_(0.5)
                torch._foreach_copy_(grads, views)

            setups: dict[str, tuple[nn.Module, Any]] = {
                "plain": (copy.deepcopy(base), None),
                "noop hooks": (hooked, None),
                "copy back": (copied, copy_back),
                "gradring": (gradring.DistributedDataParallel(copy.deepcopy(base)), None),
            }
            opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, (m, _) in setups.items()}
            times: dict[str, list[float]] = {k: [] for k in setups}
            for _ in range(a.steps):
                for key, (model, after) in setups.items():
                    t0 = time.perf_counter()
                    opts[key].zero_grad(set_to_none=True)
                    model(x).pow(2).mean().backward()
                    if after is not None:
                        after()
                    opts[key].step()
                    times[key].append(time.perf_counter() - t0)
        finally:
            dist.destroy_process_group()
    warm = min(20, a.steps // 5)
    med = {k: statistics.median(v[warm:]) for k, v in times.items()}
    print(f"{a.params} parameters of {a.numel} floats, {a.steps} interleaved steps, "
          f"plain step {med['plain'] * 1e3:.2f} ms")
    for key in ("noop hooks", "copy back", "gradring"):
        print(f"{key:<12} +{(med[key] - med['plain']) * 1e6 / a.params:6.2f} us per parameter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
