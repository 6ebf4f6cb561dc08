"""What a DDP adds per parameter per step, communication taken out: torch's and gradring's.

    python benchmarks/per_param_cost.py                        # 400 and 2,000 parameters, 5 rounds
    python benchmarks/per_param_cost.py --against HEAD~1       # and the parent's tree beside it
    python benchmarks/per_param_cost.py --paths                # each fast path's share
    python benchmarks/per_param_cost.py --params 400 --rounds 7 --steps 40
    python benchmarks/per_param_cost.py --load 2               # beside 2 spinning processes
    python benchmarks/per_param_cost.py --keep-loss            # loss kept until the next step

The model is N x ``nn.Linear(16, 16)`` applied side by side to one batch and
summed (2 parameters each: ``--params 400`` is 200 layers), world 2 on gloo, one
intra-op thread per rank. Both DDPs get torch's ``noop_hook``
(``ddp_comm_hooks.debugging_hooks``): each bucket's "reduction" is a future that
already holds the bucket, so what is left is the bookkeeping per parameter
(hooks, copies into and out of buckets, the launches and the finalize), which
on a GPU host with a fast interconnect is what decides whether a reducer
written in Python can stand beside torch's C++ one.

Each round is one job per tree (two rank processes), in which every rank
steps the plain model ("pair"), torch's DDP and gradring's DDP in turn, step
after step, in a shuffled order (``gradring/tools/bench/ddp_step.py``'s
``interleaved_round``), and keeps each set-up's median step (each step's
slowest rank). A set-up's cost per parameter is (its median step - pair's) /
parameters, in microseconds; the ratio gradring/torch is taken within each
round (the two ran side by side), and the table gives its median over the
rounds with the min-max. With ``--against REV`` the rounds alternate between
this tree and REV's (a temporary git worktree, as ``ddp_against.py`` makes
one), each running this tree's measuring code with its own gradring.

Each step's loss dies with the step (``model(x)...backward()``). With
``--keep-loss`` each model's loss is kept until its next step, as a loop that
writes ``loss = ...`` keeps it: the last graph is alive while the next forward
runs, so that forward reuses the parameters' gradient accumulators (which is
where a hook once left on an accumulator kept costing).

``--paths`` builds one gradring DDP per ``GRADRING_FAST_PATHS`` setting (the
core ``none``, each path alone, ``all``) beside torch's, and gives each one's
cost and its difference from the core: a path's share (negative: it saves).
Note that a comm hook turns ``homed`` slots into plain copies (the hook must
see the bucket), so under the no-op hook ``homed`` can only show noise.

Nothing at this module's top level imports gradring: the jobs load it by path
beside the other tree's gradring.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

#: The checkout this file belongs to: "this tree".
HERE = Path(__file__).resolve().parents[1]
#: The bench whose interleaved, shuffled steps every tree runs (this tree's copy, by path).
BENCH = HERE / "gradring" / "tools" / "bench" / "ddp_step.py"

def _job_script() -> str:
    """One rank of one job: this tree's ddp_step.py and this file, loaded by path,
    gradring from the tree given on the command line (ddp_against.py's template)."""
    if HERE.as_posix() not in sys.path:
        sys.path.insert(0, HERE.as_posix())
    from benchmarks.ddp_against import JOB_TEMPLATE

    return JOB_TEMPLATE.format(
        args="tree, bench, here, sizes, steps, flags, rank, world, store = sys.argv[1], "
             "sys.argv[2], sys.argv[3], [int(v) for v in sys.argv[4].split(',')], "
             "int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), int(sys.argv[8]), "
             "sys.argv[9]",
        name="_gr_per_param_cost",
        call="job.measure_rank(step, rank, world, store, sizes, steps, 'p' in flags, "
             "keep_loss='k' in flags)")

#: The DDP set-ups of a plain run (pair is the model without DDP).
PLAIN = ("pair", "torch", "gradring")


class SideBySide(nn.Module):
    """``layers`` x Linear(16, 16) applied to the same batch, outputs summed."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        for layer in self.layers[1:]:
            out = out + layer(x)
        return out


@contextlib.contextmanager
def _setting(value: str | None) -> Iterator[None]:
    """``GRADRING_FAST_PATHS`` set to ``value`` (left as it is for None) inside the block."""
    old = os.environ.get("GRADRING_FAST_PATHS")
    if value is not None:
        os.environ["GRADRING_FAST_PATHS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("GRADRING_FAST_PATHS", None)
        else:
            os.environ["GRADRING_FAST_PATHS"] = old


def path_settings() -> list[str]:
    """The GRADRING_FAST_PATHS values ``--paths`` measures: the core, each path
    alone, every path (from the gradring this process imported)."""
    from gradring.fast_paths import NAMES

    return ["none", *NAMES, "all"]


def _keeping_loss(bench: ModuleType) -> None:
    """Make ``bench``'s training step keep each model's loss until that model's
    next step, as a loop that writes ``loss = ...`` does: the last graph is
    still alive while the next forward runs (and reuses its accumulators)."""
    kept: dict[int, torch.Tensor] = {}

    def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        kept[id(model)] = loss

    bench.train_step = train_step


def measure_rank(bench: ModuleType, rank: int, world: int, store_path: str, sizes: list[int],
                 steps: int, paths: bool, keep_loss: bool = False
                 ) -> dict[str, dict[str, list[float]]]:
    """One rank of a job: per parameter count, each set-up's wall ms of every step
    (``bench``'s ``interleaved_round``). Only gradring's public API is used, so that
    any commit's gradring can run it."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    import gradring

    torch.set_num_threads(1)
    if keep_loss:
        _keeping_loss(bench)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    out: dict[str, dict[str, list[float]]] = {}
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for n in sizes:
        torch.manual_seed(0)
        base = SideBySide(n // 2)
        setups: dict[str, nn.Module] = {"pair": copy.deepcopy(base)}
        torch_ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        torch_ddp.register_comm_hook(None, noop_hook)
        setups["torch"] = torch_ddp
        for name in (path_settings() if paths else [None]):
            # Read at construction and at the rebuild, which the warm-up triggers.
            with _setting(name):
                ddp = gradring.DistributedDataParallel(copy.deepcopy(base))
                ddp.register_comm_hook(None, noop_hook)
                bench.time_steps(ddp, x, 3)
            setups["gradring" if name is None else f"gradring[{name}]"] = ddp
        for key in ("pair", "torch"):
            bench.time_steps(setups[key], x, 3)
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in setups.items()}
        out[str(n)] = {k: v[2] for k, v in bench.interleaved_round(setups, opts, x, steps).items()}
        del setups, torch_ddp
    dist.barrier()
    dist.destroy_process_group()
    return out


def _job(tree: str, sizes: list[int], steps: int, paths: bool, keep_loss: bool = False,
         nproc: int = 2) -> dict[str, dict[str, float]]:
    """One round in one tree: per parameter count and set-up, the median over
    steps of each step's slowest rank (ms)."""
    from benchmarks.ddp_against import run_ranks

    per_rank = run_ranks(tree, _job_script(), [str(Path(__file__).resolve()),
                                               ",".join(map(str, sizes)), str(steps),
                                               "p" * paths + "k" * keep_loss + "-"],
                        nproc, "per-parameter")
    return {n: {k: statistics.median(max(col) for col in zip(*(r[n][k] for r in per_rank)))
                for k in setups}
            for n, setups in per_rank[0].items()}


def cost_us(result: dict[str, float], key: str, params: int) -> float:
    """``key``'s added cost per parameter per step (us) over the plain model."""
    return (result[key] - result["pair"]) * 1e3 / params


def _cell(values: list[float]) -> str:
    if not values:
        return "noisy"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _ratios(num: list[float], den: list[float]) -> list[float]:
    """Round by round ``num / den``, leaving out rounds whose ``den`` is not above 0
    (a cost lost in the noise)."""
    return [a / b for a, b in zip(num, den) if b > 0]


def report(rounds: list[dict[str, dict[str, float]]], old: list[dict[str, dict[str, float]]]
           | None = None, rev: str = "") -> str:
    """The table: per parameter count, torch's and gradring's cost per parameter (us;
    median over rounds, min-max), and gradring/torch within each round; with ``old``
    (REV's rounds) the same for REV and the ratio of the two gradrings."""
    head = (f"per-parameter cost with a no-op comm hook, world 2 on gloo, N x Linear(16, 16): "
            f"us per parameter per step over no DDP, median (min-max) over {len(rounds)} rounds")
    cols = f"{'params':>7}  {'torch':>18}  {'gradring':>18}  {'gradring/torch':>18}"
    if old is not None:
        cols += f"  {'gradring ' + rev:>18}  {'its /torch':>18}  {'new/old':>18}"
    lines = [head, cols]
    for n in rounds[0]:
        params = int(n)
        t = [cost_us(r[n], "torch", params) for r in rounds]
        g = [cost_us(r[n], "gradring", params) for r in rounds]
        row = f"{params:>7}  {_cell(t):>18}  {_cell(g):>18}  " \
              f"{_cell(_ratios(g, t)):>18}"
        if old is not None:
            go = [cost_us(r[n], "gradring", params) for r in old]
            to = [cost_us(r[n], "torch", params) for r in old]
            row += f"  {_cell(go):>18}  {_cell(_ratios(go, to)):>18}  {_cell(_ratios(g, go)):>18}"
        lines.append(row)
    return "\n".join(lines)


def paths_report(rounds: list[dict[str, dict[str, float]]]) -> str:
    """Per parameter count and GRADRING_FAST_PATHS setting: its cost per parameter,
    its difference from the core's (the paths' share; within each round), and its
    ratio to torch's."""
    lines = [f"each fast path's share, no-op comm hook, world 2 on gloo: us per parameter "
             f"per step, median (min-max) over {len(rounds)} rounds",
             f"{'params':>7}  {'setting':<18}{'cost':>18}  {'minus core':>18}  {'/torch':>18}"]
    for n in rounds[0]:
        params = int(n)
        core = [cost_us(r[n], "gradring[none]", params) for r in rounds]
        t = [cost_us(r[n], "torch", params) for r in rounds]
        lines.append(f"{params:>7}  {'torch':<18}{_cell(t):>18}")
        for key in (k for k in rounds[0][n] if k.startswith("gradring[")):
            c = [cost_us(r[n], key, params) for r in rounds]
            lines.append(f"{params:>7}  {key[9:-1]:<18}{_cell(c):>18}  "
                         f"{_cell([a - b for a, b in zip(c, core)]):>18}  "
                         f"{_cell(_ratios(c, t)):>18}")
    return "\n".join(lines)


def run(sizes: list[int], rounds: int, steps: int, *, paths: bool = False,
        against: str | None = None, load: int = 0, keep_loss: bool = False) -> str:
    """Run the rounds (alternating with REV's tree round by round when ``against``)
    and return the table."""
    if HERE.as_posix() not in sys.path:
        sys.path.insert(0, HERE.as_posix())
    from benchmarks.ddp_against import _worktree
    from gradring.tools.bench.load import competing_load, load_note

    repo = old_tree = None
    if against is not None:
        repo, old_tree = _worktree(against)
    new_runs: list[dict[str, dict[str, float]]] = []
    old_runs: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(rounds):
            order = [("new", str(HERE))] + ([("old", old_tree)] if old_tree else [])
            if r % 2:
                order.reverse()
            for tag, tree in order:
                with competing_load(load):
                    result = _job(tree, sizes, steps, paths, keep_loss)
                (new_runs if tag == "new" else old_runs).append(result)
                print(f"round {r + 1}/{rounds} {tag}: " + ", ".join(
                    f"{n}: " + " ".join(f"{k} {v:.2f}" for k, v in res.items())
                    for n, res in result.items()), file=sys.stderr, flush=True)
    finally:
        if old_tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=repo,
                           check=False, capture_output=True)
    if paths:
        text = paths_report(new_runs)
        text = text if not old_runs else text + f"\n\n{against}:\n" + paths_report(old_runs)
        return load_note(load) + text
    return load_note(load) + report(new_runs, old_runs if old_tree else None, against or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/per_param_cost.py",
                                 description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=int, nargs="+", default=[400, 2000],
                    help="parameter counts (even: two per Linear(16, 16)); default 400 2000")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (one job per tree each)")
    ap.add_argument("--steps", type=int, default=30, help="steps per set-up in a round")
    ap.add_argument("--against", metavar="REV", help="also run REV's tree, round by round")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="N CPU-spinning processes beside the ranks (a loaded host)")
    ap.add_argument("--paths", action="store_true",
                    help="one gradring DDP per GRADRING_FAST_PATHS setting (each path's share)")
    ap.add_argument("--keep-loss", action="store_true",
                    help="keep each loss until the model's next step (a `loss = ...` loop)")
    a = ap.parse_args(argv)
    bad = [n for n in a.params if n < 2 or n % 2]
    if bad:
        ap.error(f"--params must be even and at least 2 (two per Linear(16, 16)), got {bad}")
    if a.rounds < 1 or a.steps < 1:
        ap.error("--rounds and --steps must be at least 1")
    print(run(a.params, a.rounds, a.steps, paths=a.paths, against=a.against, load=a.load,
              keep_loss=a.keep_loss))
    return 0


if __name__ == "__main__":
    sys.exit(main())
