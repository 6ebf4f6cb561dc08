"""``gradring bench ddp --against REV``: this tree's DDP step against another commit's.

    gradring bench ddp --against HEAD~1
    gradring bench ddp --against main --models mlp64 resnet --rounds 7 --steps 7

REV is checked out into a temporary git worktree. Two gradrings cannot live in
one process, so each round starts one measuring job per tree, alternating which
tree goes first, and every job runs the same models with the same code from
this tree's ``ddp_step.py`` (only ``import gradring`` differs: the job puts its
tree first on ``sys.path``). Inside a job, every rank steps ``pair`` (no DDP),
torch's DDP and gradring's DDP in turn, step by step, as ``gradring bench ddp``
does, and keeps each set-up's median step.

The table gives, per model, gradring's step time and overhead (step minus
pair) in each tree, the ratio new/old of the step times round by round
(median, min-max), and each tree's overhead ratio against torch's DDP measured
in the same job. A model is flagged SLOWER when every round's new/old ratio is
above 1 and the median is beyond the spread of the old tree's own rounds; a
single noisy round never flags.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))

# The job each tree runs: it imports this tree's ddp_step.py by path (model
# builders and the interleaved round; no gradring import at module level), and
# gradring from the tree given on the command line.
_JOB = r"""
import importlib.util, json, os, sys
tree, bench, models, steps, rank, world, store = sys.argv[1], sys.argv[2], \
    sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
sys.path.insert(0, tree)
spec = importlib.util.spec_from_file_location("_gr_bench_ddp_step", bench)
mod = importlib.util.module_from_spec(spec)
sys.modules["_gr_bench_ddp_step"] = mod
spec.loader.exec_module(mod)
import gradring
assert os.path.realpath(os.path.dirname(os.path.dirname(gradring.__file__))) == \
    os.path.realpath(tree), (gradring.__file__, tree)
print("RESULT " + json.dumps(mod.compare_rank(rank, world, store, models, steps)))
"""


def _job(tree: str, models: list[str], steps: int, nproc: int) -> dict[str, Any]:
    """One round in one tree: nproc rank processes; per model and set-up, the
    median over steps of each step's slowest rank (ms)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gradring-against-store-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [subprocess.Popen(
            [sys.executable, "-c", _JOB, tree, os.path.join(_HERE, "ddp_step.py"),
             ",".join(models), str(steps), str(rank), str(nproc), store],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(nproc)]
        outs = [p.communicate(timeout=1800) for p in procs]
    per_rank = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"the bench job for {tree} failed on rank {rank} "
                               f"(exit {p.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        per_rank.append(json.loads(lines[-1][len("RESULT "):]))
    merged: dict[str, Any] = {}
    for model, setups in per_rank[0].items():
        merged[model] = {k: statistics.median(max(col) for col in
                                              zip(*(r[model][k] for r in per_rank)))
                         for k in setups}
    return merged


def _worktree(rev: str) -> tuple[str, str]:
    """A detached worktree of REV in a temporary folder: (repository root, worktree path)."""
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=_HERE, check=True,
                          capture_output=True, text=True).stdout.strip()
    path = tempfile.mkdtemp(prefix="gradring-against-")
    os.rmdir(path)
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, rev], cwd=repo,
                   check=True, capture_output=True, text=True)
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
    processes beside the ranks throughout (see load.py); return the table."""
    from gradring.tools.bench.load import competing_load

    here = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
    repo, old_tree = _worktree(rev)
    new_runs: list[dict[str, Any]] = []
    old_runs: list[dict[str, Any]] = []
    try:
        with competing_load(load):
            for r in range(rounds):
                order = [("new", here), ("old", old_tree)]
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
    head = f"competing load: {load} spinning process(es) beside the ranks\n" if load else ""
    return head + report(new_runs, old_runs, rev)
