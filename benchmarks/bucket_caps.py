"""DDP overhead per bucket cap: does a smaller bucket pay, now that a collective's
fixed cost is small?

    python benchmarks/bucket_caps.py                          # resnet and mlp64, world 2
    python benchmarks/bucket_caps.py --models resnet --caps 0.25 1 25 100 auto --steps 40

Each rank builds one model per set-up, seeded alike: the model alone (the
*pair* step: the same step without DDP), torch's DDP at its defaults, and
gradring's DDP at each ``--caps`` value (``auto`` is ``bucket_cap_mb="auto"``,
``default`` leaves it unset: 25 MiB with torch's 1 MiB first bucket; an
explicit cap is also the first bucket's, as in torch). A value ending in
``@si<us>`` (``default@si500``) takes its steps with Python's GIL switch
interval (``sys.setswitchinterval``) at that many µs instead of the 5 ms
default: how long a thread that wants the GIL waits before it asks the
holder to let go. ``--load N`` runs N
processes spinning on the CPU beside the ranks.
Every step, the set-ups take one step each in a shuffled order (the same on
every rank), each started together on all ranks after a barrier and timed as
the slower rank's. A set-up's overhead is its step minus the pair step of the
same turn; the table gives the median over the steps and the range of the
medians of four consecutive quarters of them (the spread). Set-ups are
separate model instances, so an instance's memory placement can differ a
little: ``--twice`` builds every gradring set-up twice to show how much.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

from gradring.tools.bench.load import competing_load
from gradring.tools.bench.ranks import run_ranks

#: A cap ending in this and a number of µs steps with that GIL switch interval.
_SWITCH = "@si"


def _switch_s(name: str) -> float | None:
    """The GIL switch interval (seconds) set-up ``name`` steps with; None: Python's."""
    _, found, us = name.rpartition(_SWITCH)
    return float(us) * 1e-6 if found else None


def _setups(caps: list[str], twice: bool) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = [("pair", None), ("torch", None)]
    for c in caps:
        value = c.split("@", 1)[0]
        cap: Any = value if value == "auto" else None if value == "default" else float(value)
        out.append((f"gradring cap {c}", cap))
        if twice:
            out.append((f"gradring cap {c} (again)", cap))
    return out


def _rank_main(rank: int, nproc: int, store: str, model_name: str, steps: int,
               setups: list[tuple[str, Any]], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GRADRING_QUIET"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    import gradring
    from gradring.tools.bench import ddp_step

    kind, batch = ddp_step.MODELS[model_name]
    built: dict[str, tuple[Any, Any, Any]] = {}
    for name, cap in setups:
        model, make = ddp_step.build(kind)
        if name == "pair":
            m = model
        elif name == "torch":
            m = torch.nn.parallel.DistributedDataParallel(model)
        else:
            m = gradring.DistributedDataParallel(model, bucket_cap_mb=cap)
        built[name] = (m, torch.optim.SGD(m.parameters(), lr=1e-4), make(batch))

    def step(m: Any, opt: Any, x: Any) -> None:
        opt.zero_grad(set_to_none=True)
        m(x).float().pow(2).mean().backward()
        opt.step()

    for m, opt, x in built.values():  # warm-up, and the rebuild (auto decides there)
        for _ in range(4):
            step(m, opt, x)
    switch = {name: _switch_s(name) for name in built}
    python_s = sys.getswitchinterval()
    times: dict[str, list[float]] = {name: [] for name in built}
    rng = random.Random(0)  # the same order on every rank
    slowest = torch.zeros(1, dtype=torch.float64)
    for _ in range(steps):
        order = list(built)
        rng.shuffle(order)
        for name in order:
            m, opt, x = built[name]
            sys.setswitchinterval(switch[name] or python_s)
            dist.barrier()
            t0 = time.perf_counter()
            step(m, opt, x)
            slowest[0] = time.perf_counter() - t0
            sys.setswitchinterval(python_s)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name].append(slowest.item() * 1e3)
    if rank == 0:
        caps = {name: getattr(m, "bucket_bytes_cap", 0) for name, (m, _, _) in built.items()}
        buckets = {name: len(m.reducer.buckets) for name, (m, _, _) in built.items()
                   if name.startswith("gradring")}
        queue.put({"times": times, "caps": caps, "buckets": buckets})
    dist.destroy_process_group()


def report(model: str, res: dict[str, Any]) -> str:
    times = res["times"]
    pair = times["pair"]
    lines = [f"{model}: pair step {statistics.median(pair):.2f} ms (median); overhead = "
             "step - pair step of the same turn, ms, median [quarters' medians min-max]"]
    torch_ovh = statistics.median(a - b for a, b in zip(times["torch"], pair))
    for name, ts in times.items():
        if name == "pair":
            continue
        d = [a - b for a, b in zip(ts, pair)]
        q = max(1, len(d) // 4)
        quarters = [statistics.median(d[i * q:(i + 1) * q]) for i in range(len(d) // q)]
        med = statistics.median(d)
        extra = ""
        if name in res["buckets"]:
            extra = (f"  {res['buckets'][name]} bucket(s), cap {res['caps'][name] / 2**20:g} MiB"
                     f", {med / torch_ovh:.2f}x torch's")
        lines.append(f"  {name:28s} {med:7.2f} [{min(quarters):.2f}-{max(quarters):.2f}]{extra}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.bench import ddp_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet", "mlp64"],
                   choices=list(ddp_step.MODELS))
    p.add_argument("--caps", nargs="+",
                   default=["default", "0.25", "1", "5", "25", "100", "auto"],
                   help="bucket_cap_mb values (MiB, auto, or default: not given)")
    p.add_argument("--steps", type=int, default=40, help="turns (one step of each set-up)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--twice", action="store_true", help="build every gradring set-up twice")
    p.add_argument("--load", type=int, default=0, help="spinning processes beside the ranks")
    a = p.parse_args(argv)
    setups = _setups(a.caps, a.twice)
    with competing_load(a.load):
        for model in a.models:
            res = run_ranks(_rank_main, a.nproc, (model, a.steps, setups), timeout=1800)[0]
            print(report(model, res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
