"""Small collectives: gradring's all-reduce against gloo's, side by side in one run.

What it times, at world 2 (``--nproc``) on one host, for each size in ``--sizes``:

- ``gradring``: ``gradring.comm.all_reduce`` of the tensor, back to back;
- ``gloo``: ``torch.distributed.all_reduce`` of the same tensor on the same group;
- ``loss avg`` (``--loop``): a training-loop stand-in, ``--compute-us`` of busy
  work and then a 4-byte all-reduce, against the busy work alone; the figure is
  the cost the all-reduce adds to a step.

Blocks of ``--calls`` calls of each variant alternate within a round, and the
rounds repeat ``--rounds`` times; each figure is the median over rounds of the
per-call median in a block, with the spread (min-max over rounds). ``--load N``
starts N processes spinning on the CPU for the whole run, as another job on
a shared host would. ``--tree PATH`` imports gradring from another checkout
(e.g. a ``git worktree`` of the parent commit) so two trees can be compared by
running this twice, interleaved (``--against REV`` does exactly that).

    python benchmarks/small_collectives.py --rounds 5
    python benchmarks/small_collectives.py --rounds 5 --load 4
    python benchmarks/small_collectives.py --rounds 5 --against HEAD~1
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_ranks() -> Any:
    """The package's rank launcher (``gradring/tools/bench/ranks.py``) of this tree,
    loaded by path: a job of another tree (``--tree``) imports that tree's gradring,
    which may predate it. It imports nothing of gradring."""
    path = os.path.join(_HERE, "gradring", "tools", "bench", "ranks.py")
    spec = importlib.util.spec_from_file_location("_small_collectives_ranks", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.run_ranks


def _busy(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def _rank_main(rank: int, nproc: int, store: str, opts: dict[str, Any], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from gradring import comm

    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    args = argparse.Namespace(**opts)
    out: dict[str, list[float]] = {}

    def block(name: str, fn, calls: int) -> None:
        times = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        out.setdefault(name, []).append(statistics.median(times) / 1000.0)

    sizes = [int(s) for s in args.sizes.split(",")]
    tensors = {n: torch.ones(max(1, n // 4)) for n in sizes}
    scalar = torch.ones(1)
    # Warm up: connect transports, settle thresholds.
    for n in sizes:
        for _ in range(50):
            comm.all_reduce(tensors[n])
            dist.all_reduce(tensors[n])
    for _ in range(args.rounds):
        for n in sizes:
            t = tensors[n]
            block(f"gradring {n}", lambda t=t: comm.all_reduce(t), args.calls)
            block(f"gloo {n}", lambda t=t: dist.all_reduce(t), args.calls)
        if args.loop:
            steps = max(20, args.calls // 4)
            block("compute alone", lambda: _busy(args.compute_us), steps)
            block("compute + gradring loss avg",
                  lambda: (_busy(args.compute_us), comm.all_reduce(scalar)), steps)
            block("compute + gloo loss avg",
                  lambda: (_busy(args.compute_us), dist.all_reduce(scalar)), steps)
    if rank == 0:
        queue.put(out)
    comm.shutdown()
    dist.destroy_process_group()


@contextlib.contextmanager
def _load(n: int) -> Iterator[None]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
             for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _measure(opts: dict[str, Any]) -> dict[str, list[float]]:
    """One job: ``opts["nproc"]`` ranks, rank 0's per-round medians."""
    return _run_ranks()(_rank_main, opts["nproc"], (opts,), timeout=600)[0]


def _job(args: argparse.Namespace, tree: str | None) -> dict[str, list[float]]:
    """One job of this tree, or of ``tree`` (a process that imports gradring from there)."""
    opts = {k: getattr(args, k) for k in ("nproc", "sizes", "calls", "rounds", "loop",
                                          "compute_us")}
    if tree is None:
        return _measure(opts)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--job", json.dumps(opts)],
                       env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"a job of {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(vals: list[float]) -> str:
    return f"{statistics.median(vals):9.1f} [{min(vals):.1f}-{max(vals):.1f}]"


def _report(res: dict[str, list[float]], label: str = "") -> None:
    sizes = sorted({int(k.split()[-1]) for k in res if k.startswith("gradring ")})
    print(f"{label}per-call median, us (median over rounds [min-max]):")
    for n in sizes:
        g, o = res[f"gradring {n}"], res[f"gloo {n}"]
        ratios = [a / b for a, b in zip(g, o)]
        print(f"  {n:>9} B  gradring {_fmt(g)}   gloo {_fmt(o)}   "
              f"ratio {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
    if "compute alone" in res:
        base = res["compute alone"]
        for name in ("compute + gradring loss avg", "compute + gloo loss avg"):
            added = [a - b for a, b in zip(res[name], base)]
            print(f"  {name:30s} adds {_fmt(added)} us a step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks")
    p.add_argument("--sizes", default="8,1048576", help="byte sizes, comma-separated")
    p.add_argument("--calls", type=int, default=400, help="calls per block")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--loop", action="store_true", help="also time the loss average in a loop")
    p.add_argument("--compute-us", type=float, default=1000.0, help="busy work per loop step")
    p.add_argument("--load", type=int, default=0, help="spinning processes beside the ranks")
    p.add_argument("--tree", default=None, help="import gradring from this checkout")
    p.add_argument("--against", default=None,
                   help="git revision to compare with: jobs of both trees alternate")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job is not None:  # one job of another tree, started by _job
        print(json.dumps(_measure(json.loads(args.job))))
        return 0
    with _load(args.load):
        if args.against is None:
            _report(_job(args, args.tree))
            return 0
        here = _HERE
        with tempfile.TemporaryDirectory() as tmp:
            wt = os.path.join(tmp, "parent")
            subprocess.run(["git", "-C", here, "worktree", "add", "--detach", "-q", wt,
                            args.against], check=True)
            try:
                rounds, args.rounds = args.rounds, 1
                mine: dict[str, list[float]] = {}
                theirs: dict[str, list[float]] = {}
                for _ in range(rounds):
                    for acc, tree in ((mine, None), (theirs, wt)):
                        for k, v in _job(args, tree).items():
                            acc.setdefault(k, []).extend(v)
                _report(mine, "this tree: ")
                _report(theirs, f"{args.against}: ")
                for k in sorted(mine):
                    if k.startswith("gradring "):
                        r = [a / b for a, b in zip(mine[k], theirs[k])]
                        print(f"  {k}: this/against {statistics.median(r):.2f} "
                              f"[{min(r):.2f}-{max(r):.2f}]")
            finally:
                subprocess.run(["git", "-C", here, "worktree", "remove", "--force", wt])
    return 0


if __name__ == "__main__":
    sys.exit(main())
