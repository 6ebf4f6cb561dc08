"""Communication hooks side by side: step time, bytes per step, compression, codec time.

    gradring bench hooks                        # world 2, defaults (about a minute)
    gradring bench hooks --rounds 7 --steps 4   # steadier medians

Model: 12 x ``nn.Linear(1024, 1024)`` + ReLU (50 MB of fp32 gradients), per-rank
batch 64, one intra-op thread per rank, a gloo process group; the DDP reducer and
every hook communicate through gradring's own collectives (shared memory on one
host). Each rank holds one DDP instance per set-up and runs, round after round,
``--steps`` training steps of each set-up in turn, so that machine noise hits all
of them alike; figures are medians over rounds. PowerSGD starts compressing at
iteration 2 (``start_powerSGD_iter=2``), i.e. during the warm-up.

Columns:
- ms/step, and its ratio to "no-hook" (lower is better);
- payload MB/step: what this rank hands to collectives per step
  (``gradring.hooks.comm_stats()``; for "no-hook" the bucket bytes), and wire
  MB/step: what it sends under a bandwidth-optimal algorithm;
- compression: "no-hook" payload / the set-up's payload;
- codec ms/step: the hook's own compute (casts, P/Q products and
  orthogonalisation, quantization and dequantization), timed in-process by running
  the hook on this rank's real bucket layout over a one-rank process group, where
  every collective is the identity. The quantization hook then dequantizes one
  message instead of N, so its decode share is underestimated by about (N-1)/N.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SETUPS = ("local", "no-hook", "allreduce", "fp16", "bf16", "powerSGD-r1", "powerSGD-r2",
          "quant-tensor")
MIB = 2.0 ** 20
NOTE = (
    "Note: the compression ratio is not the speed-up. Step time also pays for\n"
    "the codec (its own compute, on the critical path after the last gradient), for\n"
    "latency (PowerSGD issues two dependent rounds per bucket), for the backward compute\n"
    "that communication already overlapped, and, for all-gather based quantization,\n"
    "for N - 1 incoming messages per rank. On one host, where shared-memory bandwidth\n"
    "is high, the codec can cost more than the bytes it saves."
)


def build_mlp(width: int = 1024, depth: int = 12) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def hook_for(name: str, group: Any) -> tuple[Any, Any] | None:
    """(state, hook) for a set-up name; None for "no-hook" and "local"."""
    from gradring import hooks as H

    if name in ("local", "no-hook"):
        return None
    if name.startswith("powerSGD"):
        rank = int(name.rsplit("-r", 1)[1])
        return H.PowerSGDState(group, matrix_approximation_rank=rank,
                               start_powerSGD_iter=2), H.powerSGD_hook
    return group, {"allreduce": H.allreduce_hook, "fp16": H.fp16_compress_hook,
                   "bf16": H.bf16_compress_hook,
                   "quant-tensor": H.quantization_pertensor_hook}[name]


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                steps: int) -> float:
    """Milliseconds per training step (zero_grad, forward, backward, step)."""
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
    return (time.perf_counter() - t0) / steps * 1e3


class _Bucket:
    """The GradBucket surface over a private flat buffer, to run a hook in-process."""

    __slots__ = ("_index", "_shapes", "_buffer", "_last", "_params")

    def __init__(self, index: int, shapes: list[torch.Size], flat: torch.Tensor,
                 *, last: bool) -> None:
        self._index, self._shapes, self._buffer, self._last = index, shapes, flat, last
        self._params = [torch.empty(0)] * len(shapes)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        out, at = [], 0
        for s in self._shapes:
            out.append(self._buffer[at:at + s.numel()].view(s))
            at += s.numel()
        return out

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor.reshape(-1)


def codec_ms(name: str, layout: list[tuple[list[torch.Size], torch.Tensor]], group: Any,
             repeats: int) -> float:
    """Median ms per step of running ``name``'s hook on every bucket over a one-rank group."""
    made = hook_for(name, group)
    if made is None:
        return float("nan")
    state, hook = made

    def one_step(timed: bool) -> float:
        fresh = [b.clone() for _, b in layout]  # hooks work in place; copy outside the timer
        total = 0.0
        for i, ((shapes, _), flat) in enumerate(zip(layout, fresh)):
            bucket = _Bucket(i, shapes, flat, last=i == len(layout) - 1)
            t0 = time.perf_counter()
            hook(state, bucket).wait()
            total += time.perf_counter() - t0
        return total * 1e3 if timed else 0.0

    for _ in range(3):  # PowerSGD: past start_powerSGD_iter, Q memory allocated
        one_step(False)
    return statistics.median(one_step(True) for _ in range(repeats))


def worker(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    import gradring
    from gradring.hooks import comm_stats

    # One single-rank group per rank (created by all ranks, in the same order):
    # collectives over it are the identity, which isolates a hook's own compute.
    selves = [dist.new_group([r]) for r in range(world)]
    base = build_mlp()
    x = torch.randn(opts["batch"], 1024, generator=torch.Generator().manual_seed(rank))
    models: dict[str, nn.Module] = {}
    for name in opts["setups"]:
        if name == "local":
            models[name] = copy.deepcopy(base)
            continue
        ddp = gradring.DistributedDataParallel(copy.deepcopy(base))
        made = hook_for(name, None)
        if made is not None:
            ddp.register_comm_hook(*made)
        models[name] = ddp
    optims = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k, m in models.items():  # warm-up: bucket rebuild, PowerSGD past its start
        train_steps(m, optims[k], x, opts["warmup"])
    stats = comm_stats()
    times: dict[str, list[float]] = {k: [] for k in models}
    traffic: dict[str, tuple[float, float]] = {}
    for _ in range(opts["rounds"]):
        for k, m in models.items():
            dist.barrier()
            stats.reset()
            times[k].append(train_steps(m, optims[k], x, opts["steps"]))
            snap = stats.snapshot().values()
            traffic[k] = (sum(t.payload_bytes for t in snap) / opts["steps"],
                          sum(t.wire_bytes for t in snap) / opts["steps"])
    ref = models.get("no-hook")
    if ref is None:
        ref = gradring.DistributedDataParallel(copy.deepcopy(base))
        train_steps(ref, torch.optim.SGD(ref.parameters(), lr=1e-4), x, 2)
    buckets = ref.reducer.buckets
    plain = float(sum(b.nbytes for b in buckets))
    traffic["no-hook"] = (plain, 2 * (world - 1) / world * plain)
    traffic["local"] = (0.0, 0.0)
    layout = [([p.shape for p in b.params], b.buffer.detach().clone()) for b in buckets]
    codec = {k: codec_ms(k, layout, selves[rank], opts["rounds"]) for k in models}
    dist.barrier()
    return {"times": times, "traffic": traffic, "codec": codec,
            "buckets": [b.nbytes for b in buckets]}


def report(res: dict[str, Any], world: int, opts: dict[str, Any]) -> str:
    from gradring.tools.bench.noise import figure

    fig = {k: figure(v) for k, v in res["times"].items()}
    med = {k: f.median for k, f in fig.items()}
    base_ms = med.get("no-hook", float("nan"))
    base_payload = res["traffic"]["no-hook"][0]
    lines = [
        f"Comm hooks, 12 x Linear(1024) MLP, batch {opts['batch']}/rank, world {world}, CPU, "
        f"1 thread/rank; median over {opts['rounds']} rounds of {opts['steps']} steps "
        "(± half the range across rounds)",
        f"buckets after the rebuild: {[round(b / MIB, 1) for b in res['buckets']]} MiB",
        f"{'set-up':<14}{'ms/step':>14}{'x no hook':>11}{'payload MB':>12}{'wire MB':>9}"
        f"{'compression':>13}{'codec ms':>10}",
    ]
    for k in res["times"]:
        payload, wire = res["traffic"][k]
        comp = "-" if k == "local" or payload == 0 else f"{base_payload / payload:.1f}x"
        codec = res["codec"][k]
        codec_s = "-" if codec != codec else f"{codec:.1f}"  # NaN: not a hook
        lines.append(f"{k:<14}{fig[k]!s:>14}{med[k] / base_ms:>11.2f}{payload / 1e6:>12.2f}"
                     f"{wire / 1e6:>9.2f}{comp:>13}{codec_s:>10}")
    lines.append("(local: the same model without DDP, no communication at all)")
    base_fig = fig.get("no-hook")
    if base_fig is not None:
        close = [k for k, f in fig.items() if k != "no-hook"
                 and abs(f.median - base_fig.median) < max(f.spread, base_fig.spread)]
        if close:
            lines.append("within noise of no-hook (difference smaller than the spread across "
                         f"rounds): {', '.join(close)}")
    lines += ["", NOTE]
    return "\n".join(lines)


def run(nproc: int = 2, steps: int = 2, rounds: int = 5, batch: int = 64,
        setups: tuple[str, ...] = SETUPS, warmup: int = 3) -> str:
    from gradring.tools.launch import run_local

    opts = {"steps": steps, "rounds": rounds, "batch": batch, "setups": list(setups),
            "warmup": max(warmup, 3)}
    results = run_local(worker, nproc, opts)
    return report(results[0], nproc, opts)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "gradring bench hooks", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per set-up per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS),
                    metavar="SETUP", help=f"subset of {', '.join(SETUPS)}")
    a = ap.parse_args(argv)
    if a.nproc < 2:
        ap.error("--nproc must be at least 2 (hooks need someone to talk to)")
    print(run(a.nproc, a.steps, a.rounds, a.batch, tuple(a.setups)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
