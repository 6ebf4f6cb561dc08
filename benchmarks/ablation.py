"""What each of the reducer's fast paths buys: each one off against the default, paired.

    python benchmarks/ablation.py                       # world 2, five shapes
    python benchmarks/ablation.py --load 4 --rounds 5   # under a competing load

Each rank builds, per model, the default gradring DDP (every fast path on),
the core (``GRADRING_FAST_PATHS=none``), and one DDP per fast path with that
path alone switched off (``-<name>``), beside torch's DDP and no DDP at all
(``pair``), and steps them in turn as ``gradring bench ddp`` does: every
set-up takes one step, in an order shuffled anew each step (the same on every
rank), round after round. A fast path's *gain* is, step by step, the time of
the set-up without it minus the default's step taken in the same turn (the
slower rank of each), as a median over all steps; the spread is the range of
the per-round medians of those differences. A gain whose spread includes 0
is not beyond the spread. See [Note: the core and its fast paths] in
``gradring/fast_paths.py`` for what each path does.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradring.fast_paths import NAMES
from gradring.tools.bench.ddp_step import MODELS, build, interleaved_round, time_steps
from gradring.tools.bench.load import competing_load

#: The five shapes the fast paths were measured on.
SHAPES = ["mlp64", "transformer", "gpt", "resnet", "small2000"]

#: Set-up name -> GRADRING_FAST_PATHS it is built and rebuilt under.
SETUPS = {"default": "all", "core": "none", **{f"-{n}": f"-{n}" for n in NAMES}}


def _with_fast_paths(value: str, make: Any) -> Any:
    old = os.environ.get("GRADRING_FAST_PATHS")
    os.environ["GRADRING_FAST_PATHS"] = value
    try:
        return make()
    finally:
        if old is None:
            os.environ.pop("GRADRING_FAST_PATHS", None)
        else:
            os.environ["GRADRING_FAST_PATHS"] = old


def _warm_ddp(base: nn.Module, x: torch.Tensor) -> nn.Module:
    """gradring's DDP on a copy of ``base``, stepped twice (the rebuild reads
    GRADRING_FAST_PATHS again, so it is built and warmed under one value)."""
    import gradring

    ddp = gradring.DistributedDataParallel(copy.deepcopy(base))
    time_steps(ddp, x, 2)
    return ddp


def worker(rank: int, world: int, store_path: str, args: Any, out_q: Any) -> None:

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    out: dict[str, dict[str, list[float]]] = {}
    for name in args.models:
        kind, batch = MODELS[name]
        base, make_x = build(kind)
        x = make_x(batch)
        setups: dict[str, nn.Module] = {
            "pair": copy.deepcopy(base),
            "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base))}
        for key, value in SETUPS.items():
            setups[key] = _with_fast_paths(value, functools.partial(_warm_ddp, base, x))
        for key in ("pair", "torch"):
            time_steps(setups[key], x, 2)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in setups.items()}
        steps: dict[str, list[float]] = {k: [] for k in setups}
        for r in range(args.rounds):
            for key, (_, _, walls) in interleaved_round(setups, opts, x, args.steps,
                                                        r * args.steps).items():
                steps[key].extend(walls)
        out[name] = steps
        for m in setups.values():
            m.zero_grad(set_to_none=True)
        del setups
    out_q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def report(per_rank: list[dict[str, dict[str, list[float]]]], rounds: int) -> str:
    """One row per model and set-up: the paired gain over the default, its spread
    across rounds, and the set-up's overhead over no DDP against torch's."""
    lines = ["model        set-up        gain ms/step  spread (round medians)   "
             "overhead/torch's", ]
    for name in per_rank[0]:
        slowest = {k: [max(col) for col in zip(*(r[name][k] for r in per_rank))]
                   for k in per_rank[0][name]}
        n = len(slowest["pair"]) // rounds
        torch_over = statistics.median(_minus(slowest, "torch", "pair"))
        for key in SETUPS:
            diffs = _minus(slowest, key, "default")
            per_round = [statistics.median(diffs[i * n:(i + 1) * n]) for i in range(rounds)]
            gain = statistics.median(diffs)
            beyond = "" if min(per_round) <= 0 <= max(per_round) else " *"
            ratio = statistics.median(_minus(slowest, key, "pair")) / torch_over if torch_over > 0 \
                else float("nan")
            lines.append(f"{name:<12} {key:<12} {gain:>+10.2f}  "
                         f"[{min(per_round):+7.2f}, {max(per_round):+7.2f}]{beyond:<2}     "
                         f"{ratio:>6.2f}")
    lines.append("gain: the set-up's step minus the default's in the same turn (positive: "
                 "the default is faster, so the path it lacks pays); * beyond the spread.")
    return "\n".join(lines)


def _minus(steps: dict[str, list[float]], key: str, base: str) -> list[float]:
    """Step by step, ``key``'s time minus ``base``'s in the same turn."""
    return [a - b for a, b in zip(steps[key], steps[base])]


def run(nproc: int, models: list[str], steps: int, rounds: int, load: int) -> str:
    args = argparse.Namespace(models=models, steps=steps, rounds=rounds)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp, competing_load(load):
        procs = [ctx.Process(target=worker, args=(r, nproc, os.path.join(tmp, "store"), args, q))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        per_rank = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    head = f"world {nproc}, {rounds} rounds of {steps} steps, competing load: {load}\n"
    return head + report([per_rank[r] for r in range(nproc)], rounds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=SHAPES, choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N CPU-spinning processes beside the ranks")
    a = ap.parse_args(argv)
    print(run(a.nproc, a.models, a.steps, a.rounds, a.load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
