"""DDP across two hosts on a shaped link: hooks, hierarchical vs flat ring, model vs measurement.

    sudo .venv/bin/python benchmarks/multihost.py                 # 1gbit+0.5ms and 100mbit+0.5ms
    sudo .venv/bin/python benchmarks/multihost.py --shapes 1gbit:0.5ms --rounds 3

Root only: it builds two namespace hosts with tests/multihost/netns_harness.py
(veth pair, own hostname and /dev/shm per host), shapes the link with netem on
both directions, and runs torchrun on both hosts twice per shape: 1 rank per
host (W=2) and 2 ranks per host (W=4, oversubscribed on a 2-core machine).

Each run measures, on every rank at once:
- all-reduce times over the link (flat ring; at W=4 also hierarchical) for
  a few sizes; the W=2 times calibrate the α-β link model of gradring/tools/plan.py;
- a plain backward profile (``tune.profile_backward``: per-parameter ready times);
- DDP steps for each set-up (no hook, bf16, PowerSGD rank 2; at W=4 each with
  the hierarchical and the flat ring all-reduce), interleaved in rounds;
  bytes per step from ``gradring.hooks.comm_stats()`` (payload handed to
  collectives) and from the veth's tx counters (what really crossed the link,
  both directions, headers included).

Then it prints the tables and the model's predictions: step time from the W=2
calibration (``plan.predict_step``), so the W=4 rows are out-of-sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2 ** 20
SIZES = (64 * 1024, MIB, 4 * MIB)  # all-reduce curve (bytes)
HOOKS = ("none", "bf16", "powerSGD-r2")
WIDTH, DEPTH, BATCH = 512, 4, 16  # 4 MiB of fp32 gradients


# ------------------------------------------------------------------ inside torchrun
def _workload() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(BATCH, WIDTH), lambda out: out.pow(2).mean()


def _tx_bytes() -> int:
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return 0


def _allreduce_curve(algos: list[str], reps: int) -> dict[str, dict[int, float]]:
    import torch
    import torch.distributed as dist

    from gradring import comm

    out: dict[str, dict[int, float]] = {}
    for algo in algos:
        os.environ["GRADRING_ALGO"] = algo
        out[algo] = {}
        for size in SIZES:
            t = torch.zeros(size // 4)
            comm.all_reduce(t)  # warm-up: connects, first touch
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(t)
                times.append(time.perf_counter() - t0)
            out[algo][size] = statistics.median(times)
    os.environ.pop("GRADRING_ALGO", None)
    return out


def _ddp_setups(algos: list[str]) -> dict[str, Any]:
    import torch

    import gradring
    from gradring import hooks

    setups = {}
    for algo in algos:
        for hook in HOOKS:
            os.environ["GRADRING_ALGO"] = algo
            model, x, loss_fn = _workload()
            ddp = gradring.DistributedDataParallel(model)
            if hook == "bf16":
                ddp.register_comm_hook(None, hooks.bf16_compress_hook)
            elif hook.startswith("powerSGD"):
                state = hooks.PowerSGDState(None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2)
                ddp.register_comm_hook(state, hooks.powerSGD_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
            setups[f"{algo}/{hook}"] = (algo, ddp, x, loss_fn, opt)
    return setups


def _steps(setup: Any, n: int) -> list[float]:
    algo, ddp, x, loss_fn, opt = setup
    os.environ["GRADRING_ALGO"] = algo
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x)).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def worker(steps: int, rounds: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    from gradring import hooks
    from gradring.tools import tune

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    nppn = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    algos = ["ring"] + (["hierarchical"] if nppn > 1 else [])
    curve = _allreduce_curve(algos, reps)
    profile = tune.profile_backward(_workload, warmup=2, steps=5)
    setups = _ddp_setups(algos)
    for s in setups.values():
        _steps(s, 3)  # rebuild + PowerSGD past start_powerSGD_iter
    times: dict[str, list[float]] = {k: [] for k in setups}
    tx: dict[str, int] = dict.fromkeys(setups, 0)
    payload: dict[str, int] = dict.fromkeys(setups, 0)
    stats = hooks.comm_stats()
    for _ in range(rounds):
        for key, s in setups.items():
            dist.barrier()
            stats.reset()
            b0 = _tx_bytes()
            times[key] += _steps(s, steps)
            tx[key] += _tx_bytes() - b0
            payload[key] += stats.total_payload_bytes()
    mine = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "curve": curve, "profile": profile._asdict(),
            "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "tx": tx, "payload": payload,
            "grad_bytes": sum(b.nbytes for b in setups[f"ring/{HOOKS[0]}"][1].reducer.buckets)}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        print("MHB " + json.dumps({"world": world, "nppn": nppn, "steps": steps * rounds,
                                   "ranks": everyone}), flush=True)
    from gradring import comm
    comm.shutdown()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the orchestrator
def _summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Per set-up: median over ranks of median step time, link bytes and payload per step."""
    ranks = run["ranks"]
    n = run["steps"]
    out = {}
    for key in ranks[0]["step_ms"]:
        link = sum(r["tx"][key] for r in ranks if r["local_rank"] == 0)  # one counter per host
        pay = statistics.mean(r["payload"][key] for r in ranks) or ranks[0]["grad_bytes"] * n
        out[key] = {"step_ms": max(r["step_ms"][key] for r in ranks),
                    "link_mb": link / n / 1e6, "payload_mb": pay / n / 1e6}
    curve = {a: {int(s): max(r["curve"][a][s] for r in ranks) for s in ranks[0]["curve"][a]}
             for a in ranks[0]["curve"]}
    return {"setups": out, "curve": curve}


def _mean_profile(run: dict[str, Any]) -> Any:
    from gradring.step_model import Profile

    ps = [r["profile"] for r in run["ranks"]]
    mean = statistics.fmean
    return Profile(names=ps[0]["names"], sizes=ps[0]["sizes"], keys=ps[0]["keys"],
                   ready_ms=[mean(c) for c in zip(*(p["ready_ms"] for p in ps))],
                   backward_ms=mean(p["backward_ms"] for p in ps),
                   step_ms=mean(p["step_ms"] for p in ps))


def report(results: dict[str, dict[int, dict[str, Any]]]) -> str:
    from gradring.tools import plan

    lines = []
    for shape, raw in results.items():
        by_nppn = {int(k): v for k, v in raw.items()}  # JSON turns the keys into strings
        two = _summarise(by_nppn[1])
        sizes = sorted(two["curve"]["ring"])
        link = plan.fit_link(sizes, [two["curve"]["ring"][s] for s in sizes], n=2)
        lines.append(f"\n## link {shape}: fitted from W=2 ring all-reduce: "
                     f"B = {link.bandwidth * 8 / 1e6:.0f} Mbit/s, α = {link.latency * 1e3:.2f} ms")
        lines.append(f"{'W':>3} {'algo':>12} {'size':>8} {'measured ms':>12} {'predicted ms':>13}")
        for nppn, run in sorted(by_nppn.items()):
            s = _summarise(run)
            cluster = plan.Cluster(link, nppn)
            for algo, pts in s["curve"].items():
                for size, secs in sorted(pts.items()):
                    pred = plan.allreduce_time(algo, run["world"], size, cluster)
                    lines.append(f"{run['world']:>3} {algo:>12} {size / MIB:>6.3g}Mi "
                                 f"{secs * 1e3:>12.2f} {pred * 1e3:>13.2f}")
        lines.append(f"{'W':>3} {'algo':>12} {'hook':>12} {'ms/step':>8} {'x none':>7} "
                     f"{'payload MB':>10} {'link MB':>8} {'pred ms':>8}")
        for nppn, run in sorted(by_nppn.items()):
            s = _summarise(run)
            profile = _mean_profile(run)
            cluster = plan.Cluster(link, nppn)
            for key, row in s["setups"].items():
                algo, hook = key.split("/")
                base = s["setups"][f"{algo}/none"]
                comp = base["payload_mb"] / max(row["payload_mb"], 1e-9)
                model_algo = algo if run["world"] > 2 else "auto"
                pred = plan.predict_step(profile, model_algo, run["world"], cluster,
                                        compression=comp).step_ms
                shown = f"{pred:>8.1f}" if not hook.startswith("powerSGD") else f"{'-':>8}"
                lines.append(f"{run['world']:>3} {algo:>12} {hook:>12} {row['step_ms']:>8.1f} "
                             f"{base['step_ms'] / row['step_ms']:>6.2f}x "
                             f"{row['payload_mb']:>10.3f} {row['link_mb']:>8.2f} {shown}")
            lines.append(f"    (W={run['world']}: plain step without DDP {profile.step_ms:.1f} ms, "
                         f"backward {profile.backward_ms:.1f} ms)")
            if "hierarchical/none" in s["setups"]:
                for hook in HOOKS:
                    h, r = s["setups"][f"hierarchical/{hook}"], s["setups"][f"ring/{hook}"]
                    lines.append(f"    hierarchical vs flat ring, {hook}: step "
                                 f"{r['step_ms'] / h['step_ms']:.2f}x faster, link bytes "
                                 f"{h['link_mb'] / max(r['link_mb'], 1e-9):.2f}x")
    lines.append("\nx none: speed-up over no hook with the same all-reduce. payload: bytes a rank "
                 "hands to collectives per step; link: bytes that crossed the veth per step, both "
                 "directions, TCP/IP headers included. pred: plan.predict_step with the W=2 "
                 "calibration and compression = payload ratio; the model has no codec compute, so "
                 "PowerSGD (QR, matmuls, 2 dependent rounds per bucket) is not predicted.")
    return "\n".join(lines)


def orchestrate(shapes: list[str], steps: int, rounds: int, reps: int,
                timeout: float) -> dict[str, dict[int, dict[str, Any]]]:
    # The namespace harness is the test suite's (tests/multihost/): a source checkout only.
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests.multihost.netns_harness import TwoHosts, unavailable

    why = unavailable()
    if why is not None:
        raise SystemExit(f"benchmarks/multihost.py: {why}")
    results: dict[str, dict[int, dict[str, Any]]] = {}
    with TwoHosts() as hosts:
        for shape in shapes:
            rate, _, delay = shape.partition(":")
            label = hosts.shape(rate=rate or None, delay=delay or None)
            results[shape] = {}
            for nppn in (1, 2):
                t0 = time.monotonic()
                runs = hosts.torchrun(os.path.abspath(__file__),
                                      ["--worker", f"--steps={steps}", f"--rounds={rounds}",
                                       f"--reps={reps}"], nproc_per_node=nppn, timeout=timeout)
                lines = [ln for r in runs for ln in r.lines("MHB")]
                if not lines or any(r.returncode != 0 for r in runs):
                    tail = "\n".join(r.output[-3000:] for r in runs)
                    raise SystemExit(f"run {shape} x{nppn} failed:\n{tail}")
                results[shape][nppn] = json.loads(lines[0])
                print(f"# {label}: {2 * nppn} ranks done in {time.monotonic() - t0:.0f} s",
                      flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1gbit:0.5ms,100mbit:0.5ms",
                    help="comma-separated RATE:DELAY for netem (either may be empty)")
    ap.add_argument("--steps", type=int, default=3, help="steps per set-up per round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
    ap.add_argument("--reps", type=int, default=5, help="all-reduce repetitions per size")
    ap.add_argument("--timeout", type=float, default=400.0, help="per torchrun launch (s)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.steps, a.rounds, a.reps)
        return 0
    results = orchestrate([s for s in a.shapes.split(",") if s], a.steps, a.rounds, a.reps,
                          a.timeout)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
