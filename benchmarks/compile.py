"""torch.compile with DDP: eager against compiled, torch's DDP against gradring's.

    python benchmarks/compile.py                      # world 2, aot_eager
    python benchmarks/compile.py --backend inductor --rounds 5 --steps 10

Each rank builds six set-ups of the same model (6 x ``Linear(1024, 1024)`` with
ReLU in a user-defined module, ``bucket_cap_mb=5``): no DDP, torch's DDP and
gradring's DDP, each eager and ``torch.compile(DDP(model))``. Every set-up
gets its own copy of the module class, so Dynamo compiles each one on its own.
The warm-up (3 steps: the compile, the bucket rebuild and, for gradring, its
one recompile) is timed as "compile s". Then rounds interleave the set-ups so
machine noise hits all of them alike; each round times ``--steps`` training
steps (forward, backward, SGD step). Reported: median ms/step over rounds with
the spread (min-max), the overhead against no DDP in the same mode, and for
gradring the exposed communication per step and the overlap ratio from
``overlap_stats()`` (torch's DDP exposes no such figure; its overhead column
is the comparable number). One intra-op thread per rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SETUPS = ["none eager", "none compiled", "torch eager", "torch compiled",
          "gradring eager", "gradring compiled"]


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in self.layers:
        x = torch.relu(layer(x))
    return x


def model_class(tag: str) -> type[nn.Module]:
    """A module class with a forward code object of its own (own Dynamo cache)."""
    code = _forward.__code__.replace(co_name=f"forward_{tag.replace(' ', '_')}")
    fwd = types.FunctionType(code, _forward.__globals__, code.co_name)

    def init(self: nn.Module, n: int, d: int) -> None:
        nn.Module.__init__(self)
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])

    return type(f"Stack_{tag.replace(' ', '_')}", (nn.Module,), {"__init__": init,
                                                              "forward": fwd})


def build(setup: str, args: argparse.Namespace) -> tuple[Any, nn.Module, Any]:
    """(callable model, parameters' owner, gradring DDP or None)."""
    import gradring

    kind, mode = setup.split()
    module = model_class(setup)(args.layers, args.dim)
    ddp: Any = None
    if kind == "torch":
        wrapped: nn.Module = torch.nn.parallel.DistributedDataParallel(
            module, bucket_cap_mb=args.cap)
    elif kind == "gradring":
        wrapped = ddp = gradring.DistributedDataParallel(module, bucket_cap_mb=args.cap)
    else:
        wrapped = module
    model = torch.compile(wrapped, backend=args.backend) if mode == "compiled" else wrapped
    return model, module, ddp


def steps(model: Any, params: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
          n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()
    return (time.perf_counter() - t0) / n * 1e3


def rank_main(rank: int, world: int, path: str, args: argparse.Namespace, q: Any) -> None:
    torch.set_num_threads(1)
    from gradring.compile import split as compile_split

    compile_split.SPLIT_BY = args.split
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    built, compile_s = {}, {}
    for setup in SETUPS:
        model, module, ddp = build(setup, args)
        opt = torch.optim.SGD(module.parameters(), lr=1e-4)
        dist.barrier()
        t0 = time.perf_counter()
        steps(model, module, opt, x, 3)
        compile_s[setup] = time.perf_counter() - t0
        built[setup] = (model, module, opt, ddp)
    per_round: dict[str, list[float]] = {s: [] for s in SETUPS}
    exposed: dict[str, list[float]] = {s: [] for s in SETUPS if s.startswith("gradring")}
    ratio: dict[str, list[float]] = {s: [] for s in exposed}
    for _ in range(args.rounds):
        for setup in SETUPS:
            model, module, opt, ddp = built[setup]
            dist.barrier()
            per_round[setup].append(steps(model, module, opt, x, args.steps))
            if ddp is not None:
                st = ddp.overlap_stats(last_n=args.steps)
                exposed[setup].append(st["exposed_ms"])
                ratio[setup].append(st["overlap_ratio"])
    pieces = {s: len(compile_split.splits(built[s][3])[-1].piece_buckets)
              for s in exposed if compile_split.splits(built[s][3])}
    q.put((rank, per_round, compile_s, exposed, ratio, pieces))
    dist.destroy_process_group()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap", type=float, default=5.0)
    ap.add_argument("--split", choices=["buckets", "torch"], default="buckets",
                    help="split gradring's graphs at its buckets, or by torch's DDPOptimizer")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if here not in sys.path:
        sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = tempfile.mktemp(prefix="gradring-compile-bench-")
    procs = [ctx.Process(target=rank_main, args=(r, args.nproc, path, args, q))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    if os.path.exists(path):
        os.unlink(path)
    _rank, per_round, compile_s, exposed, ratio, pieces = results[0]
    # A step ends in a collective, so the ranks' DDP times agree; the no-DDP
    # baseline is the slower rank's.
    slow = {s: [max(r[1][s][i] for r in results) for i in range(args.rounds)] for s in SETUPS}
    print(f"world {args.nproc}, backend {args.backend}, {args.layers} x Linear({args.dim}), "
          f"batch {args.batch}, bucket_cap_mb={args.cap}, {args.rounds} rounds x "
          f"{args.steps} steps, gradring split by {args.split}; median (min-max) over rounds")
    print(f"{'set-up':<18} {'ms/step':>22} {'overhead ms':>12} {'compile s':>10} "
          f"{'exposed ms':>11} {'overlap':>8} {'pieces':>6}")
    for setup in SETUPS:
        mode = setup.split()[1]
        base = statistics.median(slow[f"none {mode}"])
        med = statistics.median(per_round[setup])
        over = "" if setup.startswith("none") else f"{med - base:12.2f}"
        exp = f"{statistics.median(exposed[setup]):11.2f}" if setup in exposed else ""
        rat = f"{statistics.median(ratio[setup]):8.2f}" if setup in ratio else ""
        pcs = f"{pieces[setup]:6d}" if setup in pieces else ""
        print(f"{setup:<18} {_spread(per_round[setup]):>22} {over:>12} "
              f"{compile_s[setup]:10.2f} {exp:>11} {rat:>8} {pcs:>6}")


if __name__ == "__main__":
    main()
