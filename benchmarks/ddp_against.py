"""This tree's DDP step against another commit's, round by round.

    python benchmarks/ddp_against.py --against HEAD~1
    python benchmarks/ddp_against.py --against main --models mlp64 resnet --rounds 7 --steps 7

REV is checked out into a temporary git worktree. Two gradrings cannot live in
one process, so each round starts one measuring job per tree, alternating which
tree goes first, and every job runs the same models with the same code: this
tree's ``gradring/tools/bench/ddp_step.py`` (the bench's models and its
interleaved, shuffled steps) and this file's :func:`compare_rank`, both loaded
by path, so only ``import gradring`` differs (the job puts its tree first on
``sys.path``). Inside a job, every rank steps ``pair`` (no DDP), torch's DDP
and gradring's DDP in turn, step by step, as ``gradring bench ddp`` does, and
keeps each set-up's median step.

The table gives, per model, gradring's step time and overhead (step minus
pair) in each tree, the ratio new/old of the step times round by round
(median, min-max), and each tree's overhead ratio against torch's DDP measured
in the same job. A model is flagged SLOWER when every round's new/old ratio is
above 1 and the median is beyond the spread of the old tree's own rounds; a
single noisy round never flags.

Nothing at this module's top level imports gradring: the jobs load it by path
beside the other tree's gradring.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

#: The checkout this file belongs to: "this tree", the new side of the comparison.
HERE = Path(__file__).resolve().parents[1]
#: The bench whose models and steps both trees run (this tree's copy, loaded by path).
BENCH = HERE / "gradring" / "tools" / "bench" / "ddp_step.py"

# The job each tree runs: it loads this tree's ddp_step.py and a benchmark file by
# path (neither imports gradring at module level), and gradring from the tree given
# on the command line. ``{args}`` unpacks sys.argv into at least ``tree``, ``bench``
# and ``here``; ``{call}`` is the expression whose value the job prints (``step`` is
# the bench, ``job`` the benchmark file). per_param_cost.py fills it in too.
JOB_TEMPLATE = r"""
import importlib.util, json, os, sys
{args}
sys.path.insert(0, tree)
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
step = load("_gr_bench_ddp_step", bench)
job = load({name!r}, here)
import gradring
assert os.path.realpath(os.path.dirname(os.path.dirname(gradring.__file__))) == \
    os.path.realpath(tree), (gradring.__file__, tree)
print("RESULT " + json.dumps({call}))
"""

_JOB = JOB_TEMPLATE.format(
    args="tree, bench, here, models, steps, rank, world, store = sys.argv[1], sys.argv[2], "
         "sys.argv[3], sys.argv[4].split(','), int(sys.argv[5]), int(sys.argv[6]), "
         "int(sys.argv[7]), sys.argv[8]",
    name="_gr_bench_against",
    call="job.compare_rank(step, rank, world, store, models, steps)")


def compare_rank(bench: ModuleType, rank: int, world: int, store_path: str,
                 models: list[str], steps: int) -> dict[str, dict[str, list[float]]]:
    """One rank of a job: per model, the wall ms of each step of ``pair``, torch's
    DDP and gradring's DDP, stepped in turn with ``bench``'s (this tree's
    ``ddp_step``) ``build``, ``time_steps`` and ``interleaved_round``. Only
    gradring's public API is used, so that any commit's gradring can run it."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import gradring

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    out: dict[str, dict[str, list[float]]] = {}
    for name in models:
        kind, batch = bench.MODELS[name]
        base, make_x = bench.build(kind)
        x = make_x(batch)
        setups = {"pair": copy.deepcopy(base),
                  "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
                  "gradring": gradring.DistributedDataParallel(copy.deepcopy(base))}
        for m in setups.values():
            bench.time_steps(m, x, 2)  # warm-up; also triggers the bucket rebuild
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in setups.items()}
        out[name] = {k: v[2] for k, v in bench.interleaved_round(setups, opts, x, steps).items()}
        del setups
    dist.barrier()
    dist.destroy_process_group()
    return out


def run_ranks(tree: str, script: str, args: list[str], nproc: int, what: str
              ) -> list[dict[str, Any]]:
    """Run ``script`` (a JOB_TEMPLATE job) as ``nproc`` rank processes with gradring
    from ``tree``, each given ``args`` then its rank, ``nproc`` and a store path;
    every rank's RESULT. ``what`` names the job in an error."""
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gradring-bench-store-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen(
            [sys.executable, "-c", script, tree, str(BENCH), *args, str(rank), str(nproc), store],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(nproc)]
        outs = [p.communicate(timeout=1800) for p in procs]
    per_rank = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"the {what} job for {tree} failed on rank {rank} "
                               f"(exit {p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        per_rank.append(json.loads(lines[-1][len("RESULT "):]))
    return per_rank


def _job(tree: str, models: list[str], steps: int, nproc: int) -> dict[str, Any]:
    """One round in one tree: nproc rank processes; per model and set-up, the
    median over steps of each step's slowest rank (ms)."""
    per_rank = run_ranks(tree, _JOB, [str(Path(__file__).resolve()), ",".join(models),
                                      str(steps)], nproc, "bench")
    merged: dict[str, Any] = {}
    for model, setups in per_rank[0].items():
        merged[model] = {k: statistics.median(max(col) for col in
                                              zip(*(r[model][k] for r in per_rank)))
                         for k in setups}
    return merged


def _worktree(rev: str) -> tuple[str, str]:
    """A detached worktree of REV in a temporary folder: (repository root, worktree path)."""
    found = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE,
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"{HERE} is not a git checkout: {found.stderr.strip()}")
    repo = found.stdout.strip()
    path = tempfile.mkdtemp(prefix="gradring-against-")
    os.rmdir(path)
    added = subprocess.run(["git", "worktree", "add", "--detach", "-q", path, rev], cwd=repo,
                           capture_output=True, text=True)
    if added.returncode != 0:
        raise RuntimeError(f"cannot check out {rev!r}: {added.stderr.strip()}")
    return repo, path


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def report(new: list[dict[str, Any]], old: list[dict[str, Any]], rev: str) -> str:
    """The new/old table over rounds (each entry: model -> set-up -> median ms)."""
    lines = [f"DDP step, this tree (new) against {rev} (old): medians over {len(new)} "
             "alternating rounds, ms/step",
             f"{'model':<12}{'old':>9}{'new':>9}{'new/old':>9}{'spread':>12}"
             f"{'ovh old':>9}{'ovh new':>9}{'vs torch old':>14}{'vs torch new':>14}  verdict"]
    for model in new[0]:
        step_n = [r[model]["gradring"] for r in new]
        step_o = [r[model]["gradring"] for r in old]
        ratios = [n / o for n, o in zip(step_n, step_o)]
        ovh = {tag: [r[model]["gradring"] - r[model]["pair"] for r in runs]
               for tag, runs in (("new", new), ("old", old))}
        vs_torch = {}
        for tag, runs in (("new", new), ("old", old)):
            per = [(m["gradring"] - m["pair"]) / (m["torch"] - m["pair"])
                   for m in (r[model] for r in runs) if m["torch"] > m["pair"]]
            vs_torch[tag] = f"{statistics.median(per):.2f}" if per else "noisy"
        med = statistics.median(ratios)
        old_spread = (max(step_o) - min(step_o)) / statistics.median(step_o)
        slower = min(ratios) > 1.0 and med - 1.0 > old_spread / 2
        lines.append(
            f"{model:<12}{statistics.median(step_o):>9.2f}{statistics.median(step_n):>9.2f}"
            f"{med:>9.3f}{_spread(ratios):>12}{statistics.median(ovh['old']):>9.2f}"
            f"{statistics.median(ovh['new']):>9.2f}{vs_torch['old']:>14}{vs_torch['new']:>14}"
            f"  {'SLOWER' if slower else 'ok'}")
    return "\n".join(lines)


def run_against(rev: str, models: list[str], steps: int, rounds: int, nproc: int,
                load: int = 0) -> str:
    """Alternate this tree and REV round by round, with ``load`` CPU-spinning
    processes beside the ranks throughout; return the table."""
    from gradring.tools.bench.load import competing_load, load_note

    repo, old_tree = _worktree(rev)
    new_runs: list[dict[str, Any]] = []
    old_runs: list[dict[str, Any]] = []
    try:
        with competing_load(load):
            for r in range(rounds):
                order = [("new", str(HERE)), ("old", old_tree)]
                if r % 2:
                    order.reverse()
                for tag, tree in order:
                    result = _job(tree, models, steps, nproc)
                    (new_runs if tag == "new" else old_runs).append(result)
                    print(f"round {r + 1}/{rounds} {tag}: " + ", ".join(
                        f"{m} {v['gradring']:.1f}" for m, v in result.items()),
                          file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=repo,
                       check=False, capture_output=True)
    return load_note(load) + report(new_runs, old_runs, rev)


def main(argv: list[str] | None = None) -> int:
    from gradring.tools.bench import ddp_step

    ap = argparse.ArgumentParser(prog="python benchmarks/ddp_against.py",
                                 description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--against", metavar="REV", required=True,
                    help="the git revision to run against this tree (required)")
    ddp_step.add_run_arguments(ap)
    a = ap.parse_args(argv)
    ddp_step.check_run_arguments(ap, a)
    print(run_against(a.against, a.models, a.steps, a.rounds, a.nproc, load=a.load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
