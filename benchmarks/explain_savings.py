"""Does ``gradring explain`` predict what its findings save? Apply each one and measure.

    python benchmarks/explain_savings.py                      # 2 ranks, 5 rounds
    python benchmarks/explain_savings.py --rounds 9 --steps 20 --cap 0.05

Two ranks on gloo train torch's DDP on 8 x Linear(512, 512) with a constant
4 MiB buffer, ``find_unused_parameters=True`` and ``bucket_cap_mb=--cap``: a
set-up with something to find. Each rank profiles 9 steps as the torch docs
show (``schedule(wait=1, warmup=2, active=6)``, ``tensorboard_trace_handler``)
and rank 0 runs ``gradring explain`` on the folder. Then, for each finding
whose change is a DDP argument (or a comm hook), the ranks build the set-up
as it was and as the finding says, and time them in turns: every round takes
``--steps`` steps of each, in an order that alternates, each step started
together after a barrier and timed as the slower rank's. A round's realized
saving is the median step as it was less the median step changed; the table
gives the median over the rounds and their range (the spread), beside the
saving explain predicted from the trace.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from gradring.tools.bench.ranks import run_ranks  # noqa: E402


def change_of(key: str, change: str, base: dict[str, Any]) -> dict[str, Any] | None:
    """The DDP arguments a finding's change names, applied to ``base`` (None: not one a
    benchmark can apply, such as the straggler's)."""
    kw = dict(base)
    if key == "bucket_cap":
        m = re.search(r"bucket_cap_mb=([0-9.]+)", change)
        if not m:
            return None
        kw["bucket_cap_mb"] = float(m.group(1))
    elif key == "first_bucket":
        return kw  # already passed explicitly here: nothing to change
    elif key == "find_unused":
        kw["find_unused_parameters"] = False
    elif key == "forward_sync_buffers":
        kw["broadcast_buffers"] = False
    elif key == "bucket_view":
        kw["gradient_as_bucket_view"] = True
    elif key == "comm_hook":
        kw["_hook"] = "fp16"
    else:
        return None
    return kw


def _build(kw: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(8)))
    model.register_buffer("table", torch.randn(1 << 20))  # 4 MiB, never written
    args = {k: v for k, v in kw.items() if not k.startswith("_")}
    ddp = nn.parallel.DistributedDataParallel(model, **args)
    if kw.get("_hook") == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            fp16_compress_hook,
        )

        ddp.register_comm_hook(None, fp16_compress_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4)


def _step(ddp: Any, opt: Any, x: Any) -> None:
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    opt.step()


def _rank_main(rank: int, nproc: int, store: str, cap: float, rounds: int, steps: int,
               out: str, queue: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, nproc), rank=rank,
                            world_size=nproc)
    base = {"bucket_cap_mb": cap, "find_unused_parameters": True}
    x = torch.randn(16, 512)
    ddp, opt = _build(base)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=2, active=6),
                 on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}")) as p:
        for _ in range(9):
            _step(ddp, opt, x)
            p.step()
    dist.barrier()
    found: list[Any] = [None]
    if rank == 0:
        from gradring.tools import analysis, findings
        from gradring.tools.explain import explain_path
        from gradring.tools.read_profiler import read_profiler
        from gradring.tools.trace_file import read_json, trace_files

        x_ = explain_path(out)
        model = read_profiler([(f, read_json(f)) for f in trace_files(out)])
        parts, kept, _, rows_ = analysis.summarise(model)
        # every candidate, those explain called too noisy to tell included
        every, _ = findings.profile_findings(model, parts, rows_, kept, keep_noisy=True)
        given = {f.key for f in x_.findings}
        found[0] = ([(f.key + ("" if f.key in given else " (noisy)"), f.change, f.saving_ms)
                     for f in every], x_.notes, x_.parts[0]["step"])
    dist.broadcast_object_list(found, src=0)
    findings, notes, profiled_step = found[0]
    rows = []
    for key, change, predicted in findings:
        kw = change_of(key.split(" ")[0], change, base)
        if kw is None:
            rows.append((key, change, predicted, None, None))
            continue
        setups = {"as it was": _build(base), "changed": _build(kw)}
        per_round = []
        for r in range(rounds):
            med = {}
            order = list(setups) if r % 2 == 0 else list(reversed(setups))
            for name in order:
                m, o = setups[name]
                for _ in range(2):
                    _step(m, o, x)  # warm
                times = []
                for _ in range(steps):
                    dist.barrier()
                    t = time.perf_counter()
                    _step(m, o, x)
                    dt = torch.tensor([time.perf_counter() - t])
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    times.append(float(dt) * 1e3)
                med[name] = statistics.median(times)
            per_round.append(med["as it was"] - med["changed"])
        rows.append((key, change, predicted, statistics.median(per_round),
                     (min(per_round), max(per_round))))
    if rank == 0:
        queue.put({"rows": rows, "notes": notes, "profiled_step": profiled_step})
    dist.destroy_process_group()


def report(res: dict[str, Any], rounds: int, steps: int) -> str:
    lines = [f"explain's predicted saving against the realized one ({rounds} rounds of "
             f"{steps} steps per set-up; profiled step {res['profiled_step']:.2f} ms)",
             f"{'finding':<22}{'predicted ms':>13}{'realized ms':>13}  realized range   change"]
    for key, change, predicted, med, rng in res["rows"]:
        if med is None:
            lines.append(f"{key:<22}{predicted:>13.2f}{'-':>13}  {'-':<15}  {change} "
                         "(not applied)")
        else:
            lines.append(f"{key:<22}{predicted:>13.2f}{med:>13.2f}  "
                         f"{rng[0]:>6.2f}..{rng[1]:<6.2f}  {change}")
    if not res["rows"]:
        lines.append("(no finding)")
    lines += [f"note: {n}" for n in res["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=float, default=0.05, help="bucket_cap_mb of the set-up")
    p.add_argument("--rounds", type=int, default=5, help="rounds per finding")
    p.add_argument("--steps", type=int, default=10, help="steps per set-up and round")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="explain-savings-") as tmp:
        res = run_ranks(_rank_main, a.nproc, (a.cap, a.rounds, a.steps, tmp),
                        timeout=1800)[0]
    print(report(res, a.rounds, a.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
