"""DDP step time: gradring vs torch DDP, side by side in one run.

    gradring bench ddp                 # world 2, all models
    gradring bench ddp --nproc 2 --steps 10 --rounds 5 --models mlp64

(``python benchmarks/ddp_step.py`` in a source checkout runs the same.)

Each rank runs, round after round, the same model under three set-ups:
``pair`` (no DDP: every rank computes, nobody communicates), torch's DDP over
the process group, and gradring's DDP. Rounds interleave the set-ups so that
machine noise hits all of them alike; figures are medians over rounds.
One intra-op thread per rank.

Overhead = DDP ms/step - pair ms/step. A DDP step cannot end before its slowest
rank has computed, and on a loaded 2-core VM one core is often a few ms
slower than the other, so a round's pair time is the slower rank's (its DDP
times agree across ranks: every step ends in a collective). The last column
shows the ratio against rank 0's pair time alone, for comparison.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MODELS = {
    # name: (builder, per-rank input maker)
    "mlp64": ("mlp", 64),
    "mlp8": ("mlp", 8),
    "transformer": ("transformer", 16),
}


def build(kind: str) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[nn.Module] = []
        for _ in range(12):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers), lambda b: torch.randn(b, 1024)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True), 4,
        enable_nested_tensor=False)
    return enc, lambda b: torch.randn(b, 128, 256)


def time_steps(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e3


def grad_bytes_outside_buckets(ddp: Any) -> tuple[int, int]:
    """(bytes of .grad storage not inside a bucket, plus the spent gradients the
    reducer keeps for reuse (see gradring/lending.py); bytes of bucket buffers)."""
    buffers = [b.buffer for b in ddp.reducer.buckets]
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers]
    outside = sum(t.numel() * t.element_size() for t in ddp.reducer._recycled.values())
    for p in ddp.module.parameters():
        if p.grad is not None and not any(lo <= p.grad.data_ptr() < hi for lo, hi in spans):
            outside += p.grad.numel() * p.grad.element_size()
    return outside, sum(hi - lo for lo, hi in spans)


def worker(rank: int, world: int, store_path: str, args: Any, out_q: Any) -> None:
    import gradring

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    results: dict[str, dict[str, list[float]]] = {}
    for name in args.models:
        kind, batch = MODELS[name]
        base, make_x = build(kind)
        x = make_x(batch)
        setups = {
            "pair": copy.deepcopy(base),
            "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
            "gradring": gradring.DistributedDataParallel(copy.deepcopy(base)),
            "gradring_view": gradring.DistributedDataParallel(
                copy.deepcopy(base), gradient_as_bucket_view=True),
        }
        for m in setups.values():
            time_steps(m, x, 2)  # warm-up; also triggers the bucket rebuild
        res: dict[str, list[float]] = {k: [] for k in setups}
        for _ in range(args.rounds):
            for key, m in setups.items():
                dist.barrier()
                res[key].append(time_steps(m, x, args.steps))
        results[name] = res
        if rank == 0:
            results[name]["_mem"] = [float(v) for v in
                                     grad_bytes_outside_buckets(setups["gradring"])
                                     + grad_bytes_outside_buckets(setups["gradring_view"])]
    out_q.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _slowest(per_rank: list[dict[str, dict[str, list[float]]]]
             ) -> dict[str, dict[str, list[float]]]:
    """Per model, set-up and round: the slowest rank's time (rank 0's extras kept)."""
    merged: dict[str, dict[str, list[float]]] = {}
    for name, res in per_rank[0].items():
        merged[name] = {k: ([max(r[name][k][i] for r in per_rank) for i in range(len(v))]
                            if not k.startswith("_") else v) for k, v in res.items()}
        merged[name]["_pair_rank0"] = res["pair"]
    return merged


def report(results: dict[str, dict[str, list[float]]], world: int) -> str:
    lines = [f"DDP step time, world {world}, CPU, 1 thread/rank (median ms/step over rounds;",
             "pair = the slower rank's, see the docstring)",
             f"{'model':<12}{'pair':>8}{'torch':>8}{'gradring':>10}{'g/torch':>9}"
             f"{'ovh torch':>11}{'ovh gradring':>14}{'ovh ratio':>11}{'view':>8}"
             f"{'ratio vs rank0 pair':>21}"]
    for name, res in results.items():
        med = {k: statistics.median(v) for k, v in res.items() if k != "_mem"}
        ot, og = med["torch"] - med["pair"], med["gradring"] - med["pair"]
        ratio = og / ot if ot > 0 else float("nan")
        p0 = med["_pair_rank0"]
        ratio0 = (med["gradring"] - p0) / (med["torch"] - p0)
        lines.append(
            f"{name:<12}{med['pair']:>8.1f}{med['torch']:>8.1f}{med['gradring']:>10.1f}"
            f"{med['gradring'] / med['torch']:>9.2f}{ot:>11.1f}{og:>14.1f}{ratio:>11.2f}"
            f"{med['gradring_view']:>8.1f}{ratio0:>21.2f}")
    for name, res in results.items():
        if "_mem" in res:
            out_plain, buck_plain, out_view, buck_view = res["_mem"]
            mib = 2.0**20
            lines.append(
                f"{name}: gradient memory without bucket view "
                f"{(out_plain + buck_plain) / mib:.1f} MiB (private grads {out_plain / mib:.1f} + "
                f"buckets {buck_plain / mib:.1f}); with gradient_as_bucket_view "
                f"{(out_view + buck_view) / mib:.1f} MiB")
    return "\n".join(lines)


def run(nproc: int = 2, models: list[str] | None = None, steps: int = 5,
        rounds: int = 5) -> str:
    args = argparse.Namespace(models=models or list(MODELS), steps=steps, rounds=rounds)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, nproc, os.path.join(tmp, "store"), args, q))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        per_rank = dict(q.get() for _ in procs)
        for p in procs:
            p.join()
    return report(_slowest([per_rank[r] for r in range(nproc)]), nproc)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    print(run(a.nproc, a.models, a.steps, a.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
