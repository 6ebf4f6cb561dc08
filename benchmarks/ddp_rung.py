"""The rung: gradring's DDP overhead in units of one all-reduce of the model's gradients.

    python benchmarks/ddp_rung.py                       # world 2, all models
    python benchmarks/ddp_rung.py --models mlp64 mlp8 --rounds 6 --steps 7

A DDP step cannot cost less than moving its gradients once, so this is how far
the reducer is from the physical limit (the target is 1.5). It runs ``gradring
bench ddp`` (``gradring.tools.bench.ddp_step.measure``) and, after each model's
rounds, times one all-reduce of as many bytes as the model's gradients,
resident in shared memory (a ``comm.empty`` buffer, as ``gradring bench
allreduce`` times it; every call started together on all ranks, the slowest
rank's time per call, median over 9 calls). It prints the bench's tables and
then, per model, gradring's and torch's overhead (paired per step where the
steps were kept, else per round) divided by that all-reduce.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch.distributed as dist
from torch import nn

from gradring.tools.bench import ddp_step
from gradring.tools.bench.load import load_note

#: All-reduce calls timed per model.
REPS = 9


def allreduce_ms(nbytes: int, reps: int = REPS) -> list[float]:
    """Each of ``reps`` calls' ms for an all-reduce of ``nbytes`` resident in shared
    memory (``comm.empty``), every call started together on all ranks of the
    default group (collective: every rank calls it)."""
    from gradring import comm

    buf = comm.empty(max(1, nbytes // 4)).zero_()
    comm.all_reduce(buf)  # connect and fault the pages in outside the timing
    comm.all_reduce(buf)
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        comm.all_reduce(buf)
        out.append((time.perf_counter() - t0) * 1e3)
    del buf
    return out


def probe(model: nn.Module) -> dict[str, list[float]]:
    """The bench's per-model probe: the gradient bytes and the all-reduce times."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"_bytes": [float(nbytes)], "allreduce_ms": allreduce_ms(nbytes)}


def rung_table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    """gradring's and torch's overhead / one resident all-reduce of the model's
    gradient bytes; no lines when no model was probed."""
    rows = [name for name, res in results.items() if "allreduce_ms" in res]
    if not rows:
        return []
    lines = ["", "rung: gradring's overhead / one all-reduce of the model's gradient bytes, "
             "resident in shared memory (target <= 1.5)",
             f"{'model':<12}{'MiB':>8}{'all-reduce ms':>15}{'ovh gradring':>14}"
             f"{'ovh torch':>11}{'gradring/AR':>13}{'torch/AR':>10}"]
    for name in rows:
        res = results[name]
        ar = statistics.median(res["allreduce_ms"])
        og = statistics.median(ddp_step.paired(res, "gradring") or
                               [g - p for g, p in zip(res["gradring"], res["pair"])])
        ot = statistics.median(ddp_step.paired(res, "torch") or
                               [t - p for t, p in zip(res["torch"], res["pair"])])
        mib = res["_bytes"][0] / 2.0**20 if "_bytes" in res else float("nan")
        lines.append(f"{name:<12}{mib:>8.2f}{ar:>15.3f}{og:>14.2f}{ot:>11.2f}"
                     f"{og / ar:>13.2f}{ot / ar:>10.2f}")
    return lines


def run(nproc: int = 2, models: list[str] | None = None, steps: int = 5, rounds: int = 5,
        load: int = 0) -> str:
    """The bench with the all-reduce probe: the bench's tables, then the rung's."""
    results = ddp_step.measure(nproc, models, steps, rounds, load=load, probe=probe)
    return "\n".join([load_note(load) + ddp_step.report(results, nproc),
                      *rung_table(results)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/ddp_rung.py", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ddp_step.add_run_arguments(ap)
    a = ap.parse_args(argv)
    ddp_step.check_run_arguments(ap, a)
    print(run(a.nproc, a.models, a.steps, a.rounds, a.load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
