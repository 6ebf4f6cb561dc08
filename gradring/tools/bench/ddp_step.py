"""DDP step time: gradring vs torch DDP, side by side in one run.

    gradring bench ddp                 # world 2, all models
    gradring bench ddp --nproc 2 --steps 10 --rounds 5 --models mlp64 small2000

Each rank runs, round after round, the same model under these set-ups:
``pair`` (no DDP: every rank computes, nobody communicates), torch's DDP over
the process group, gradring's DDP, gradring's with gradient_as_bucket_view,
and gradring's with its always-on trace switched off (``notrace``). Rounds
interleave the set-ups step by step (every set-up takes one step in turn, in
an order shuffled anew each step, the ranks starting each step together), so
that a slow stretch of the machine hits all of them alike. A round's figure
is the median of its steps, each timed on its own; the tables give medians
over rounds. One intra-op thread per rank.

Models: ``mlp64``/``mlp8`` (12 x Linear(1024), batch 64 / 8 per rank),
``transformer`` (4 torch encoder layers, d 256, seq 128), ``gpt`` (GPT-shaped:
4 pre-norm blocks, d 256, 4 heads, seq 64, vocab 512, batch 4; 53 tensors),
``resnet`` (ResNet-shaped: 8 basic blocks with BatchNorm, 32x32 images,
batch 8; 62 tensors) and ``small2000`` (2,000 tensors of 64 floats: what the
reducer costs per parameter, with almost no compute or bytes).

Overhead = DDP ms/step - pair ms/step. A DDP step cannot end before its slowest
rank has computed, so a pair step's time is the slower rank's *in that step*
(the ranks start each step together), and a round's pair time is the median
of those. On a 2-core VM the slower rank changes from step to step: the
ResNet-shaped model's two ranks differ by about 6 ms in a typical step,
and the median of the per-step slower rank lies about 3 ms above the slower
rank's own median, a cost that any DDP which waits for every rank pays and
no reducer can remove. (DDP times agree across ranks: every step ends in a
collective.) Two more columns show the ratio against the older, lower
baselines for comparison: the slower rank's median ("vs median pair"), and
rank 0's pair time alone. The
second table gives, per model, the overhead ratio's spread across rounds
(each round's ratio, min-max), and the overhead in microseconds per parameter
per step for torch, gradring, and gradring without tracing. The third gives
the same overheads in CPU time (``time.process_time`` of rank 0's process,
every thread): on a loaded machine wall-clock overheads swing by more than
they are worth, while CPU time still counts the work each reducer does.

The *paired* table takes every step on its own: each DDP step minus the
pair step taken beside it (the slower rank of each), and the median of those
differences over the whole run. On a machine whose speed drifts from second
to second (a shared VM), this moves far less than a difference of medians
over rounds, so it is the figure to quote there; its ``halves`` column gives
the ratio over the first and the second half of the steps, which shows how
much the figure itself moved.

``--load N`` runs N processes that spin on the CPU beside the ranks for the
whole run: the same comparison on a host that another job is using.

A source checkout's ``benchmarks/`` folder holds developer studies built on
this bench: ``ddp_against.py`` (this tree against another commit),
``ddp_floor.py`` (a minimal DDP as the floor) and ``ddp_rung.py`` (the
overhead in units of one all-reduce).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODELS = {
    # name: (builder, per-rank batch)
    "mlp64": ("mlp", 64),
    "mlp8": ("mlp", 8),
    "transformer": ("transformer", 16),
    "gpt": ("gpt", 4),
    "resnet": ("resnet", 8),
    "small2000": ("small", 4),
}


class _Block(nn.Module):
    """A pre-norm GPT block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class _Gpt(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 256, heads: int = 4, blocks: int = 4,
                 seq: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_Block(d, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + self.short(x))


def _resnet() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                               nn.ReLU()]
    cin = 16
    for stage, cout in enumerate((16, 32, 64, 128)):
        for j in range(2):
            layers.append(_BasicBlock(cin, cout, 2 if stage and j == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers)


class _ManySmall(nn.Module):
    """``n`` parameters of ``d`` floats, each added once: the reducer's cost per parameter."""

    def __init__(self, n: int = 2000, d: int = 64) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(d) * 0.01) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.ps:
            x = x + p
        return x


def build(kind: str) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    """The model of kind ``kind`` (see MODELS), seeded alike on every rank, and a
    function that makes an input batch of a given size."""
    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[nn.Module] = []
        for _ in range(12):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        return nn.Sequential(*layers), lambda b: torch.randn(b, 1024)
    if kind == "gpt":
        return _Gpt(), lambda b: torch.randint(0, 512, (b, 64))
    if kind == "resnet":
        return _resnet(), lambda b: torch.randn(b, 3, 32, 32)
    if kind == "small":
        return _ManySmall(), lambda b: torch.randn(b, 64)
    enc = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True), 4,
        enable_nested_tensor=False)
    return enc, lambda b: torch.randn(b, 128, 256)


def time_steps(model: nn.Module, x: torch.Tensor, steps: int) -> tuple[float, float]:
    """(wall ms/step, this process's CPU ms/step, all its threads), the median
    over ``steps`` steps, each timed on its own (warm-ups and tools)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    walls, cpus = [], []
    for _ in range(steps):
        wall, cpu = _one_step(model, opt, x)
        walls.append(wall)
        cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    """One training step of a bench model: forward, a squared-mean loss, backward,
    SGD."""
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def gradring_ddp(model_name: str, **ddp_kwargs: Any
                 ) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Bench model ``model_name`` under gradring's DDP (``ddp_kwargs`` as for its
    constructor), its optimizer and its batch; for a rank whose process group is
    up."""
    import gradring

    kind, batch = MODELS[model_name]
    model, make = build(kind)
    ddp = gradring.DistributedDataParallel(model, **ddp_kwargs)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4), make(batch)


def _one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
              ) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    train_step(model, opt, x)
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def interleaved_round(setups: dict[str, nn.Module], opts: dict[str, torch.optim.Optimizer],
                      x: torch.Tensor, steps: int, first_step: int = 0
                      ) -> dict[str, tuple[float, float, list[float]]]:
    """One round: step after step, every set-up takes one step in turn (all
    ranks start each together), so that a slow stretch of the machine hits
    them alike; per set-up, the median wall and CPU ms of its steps, and the
    wall ms of each step (in order, so that ranks' steps pair up). The turn
    order is shuffled each step, the same on every rank (seeded by the step's
    number, which goes on from ``first_step``, the steps of the rounds
    before): a set-up that always ran first, or always right after torch's
    DDP, would carry that place's cost in all its figures (see "Shuffled
    turns" in docs/collectives.md).
    """
    walls: dict[str, list[float]] = {k: [] for k in setups}
    cpus: dict[str, list[float]] = {k: [] for k in setups}
    keys = list(setups)
    for step in range(first_step, first_step + steps):
        random.Random(step).shuffle(keys)
        for key in keys:
            m = setups[key]
            dist.barrier()
            wall, cpu = _one_step(m, opts[key], x)
            walls[key].append(wall)
            cpus[key].append(cpu)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k]), walls[k])
            for k in setups}


def grad_bytes_outside_buckets(ddp: Any) -> tuple[int, int]:
    """(bytes of .grad storage not inside a bucket; bytes of bucket buffers)."""
    return (ddp.reducer.grad_bytes_outside_buckets(),
            sum(b.nbytes for b in ddp.reducer.buckets))


#: The set-ups every run steps (see the module docstring).
BASE_SETUPS = ("pair", "torch", "gradring", "gradring_view", "notrace")

#: An extra set-up for :func:`measure`: builds the module to step from a copy of the
#: model. It is sent to spawned ranks, so it must be picklable: a module-level
#: function or class, not a lambda.
SetupFactory = Callable[[nn.Module], nn.Module]

#: A per-model probe for :func:`measure`: runs on every rank, in step, after the
#: model's rounds, and returns extra series for its results. Series named without a
#: leading underscore are merged as the slowest rank's, index by index; those named
#: ``_...`` are rank 0's. Picklable, as a SetupFactory.
ModelProbe = Callable[[nn.Module], dict[str, list[float]]]


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
            "notrace": gradring.DistributedDataParallel(copy.deepcopy(base)),
        }
        setups["notrace"].reducer.trace.enabled = False
        for key, factory in args.extra_setups.items():
            setups[key] = factory(copy.deepcopy(base))
        for m in setups.values():
            time_steps(m, x, 2)  # warm-up; also triggers the bucket rebuild
        res: dict[str, list[float]] = {k: [] for k in setups}
        res.update({"_cpu_" + k: [] for k in setups})
        res["_pair_steps"] = []  # every pair step's wall ms, round after round
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in setups.items()}
        for r in range(args.rounds):
            for key, (wall, cpu, walls) in interleaved_round(setups, opts, x, args.steps,
                                                             r * args.steps).items():
                res[key].append(wall)
                res["_cpu_" + key].append(cpu)
                res.setdefault("_steps_" + key, []).extend(walls)
                if key == "pair":
                    res["_pair_steps"].extend(walls)
        results[name] = res
        res["_nparams"] = [float(sum(1 for p in base.parameters() if p.requires_grad))]
        if args.probe is not None:
            res.update(args.probe(base))
        if rank == 0:
            results[name]["_mem"] = [float(v) for v in
                                     grad_bytes_outside_buckets(setups["gradring"])
                                     + grad_bytes_outside_buckets(setups["gradring_view"])]
        for m in setups.values():  # free the buffers before the next model
            m.zero_grad(set_to_none=True)
        del setups
    out_q.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _slowest(per_rank: list[dict[str, dict[str, list[float]]]]
             ) -> dict[str, dict[str, list[float]]]:
    """Per model, set-up and round: the slowest rank's time (rank 0's extras kept).
    The pair's is the median over the round's steps of each step's slowest
    rank; ``_pair_median`` keeps the slowest rank's median, ``_pair_rank0``
    rank 0's."""
    merged: dict[str, dict[str, list[float]]] = {}
    for name, res in per_rank[0].items():
        merged[name] = {k: ([max(r[name][k][i] for r in per_rank) for i in range(len(v))]
                            if not k.startswith("_") else v) for k, v in res.items()}
        merged[name]["_pair_rank0"] = res["pair"]
        merged[name]["_pair_median"] = merged[name]["pair"]
        steps = [r[name].get("_pair_steps") for r in per_rank]
        rounds = len(res["pair"])
        if rounds and all(steps) and len({len(s) for s in steps if s}) == 1:
            per_step = [max(col) for col in zip(*steps)]  # type: ignore[misc]
            n = len(per_step) // rounds
            merged[name]["pair"] = [statistics.median(per_step[i * n:(i + 1) * n])
                                    for i in range(rounds)]
        for key in [k for k in res if k.startswith("_steps_")]:
            cols = [r[name].get(key) for r in per_rank]
            if all(cols) and len({len(c) for c in cols if c}) == 1:
                merged[name][key] = [max(col) for col in zip(*cols)]  # type: ignore[misc]
    return merged


def paired(res: dict[str, Any], key: str, base: str = "pair") -> list[float] | None:
    """Each step's ``key`` time minus the ``base`` step taken just before or after
    it (the slower rank of each, see _slowest), or None without per-step times.
    Neighbouring steps saw the same machine, so the median of these differences
    moves far less with the machine's load than a difference of medians does."""
    a, b = res.get("_steps_" + key), res.get("_steps_" + base)
    if not a or not b or len(a) != len(b):
        return None
    return [x - y for x, y in zip(a, b)]


def _paired_ratio(res: dict[str, Any], key: str) -> float | None:
    """Median paired overhead of ``key`` over torch's (None without per-step times)."""
    mine, theirs = paired(res, key), paired(res, "torch")
    if mine is None or theirs is None:
        return None
    t = statistics.median(theirs)
    return statistics.median(mine) / t if t > 0 else float("nan")


def report(results: dict[str, dict[str, list[float]]], world: int) -> str:
    """Medians over rounds ± half their range; ratios only where noise allows
    (``noise.ratio``), otherwise a footnote says why."""
    from gradring.tools.bench.noise import effect, figure, ratio

    lines = [f"DDP step time, world {world}, CPU, 1 thread/rank (median ms/step over rounds "
             "± half the range across rounds;",
             "pair = each step's slower rank, see the docstring; ovh = DDP - pair, "
             "round by round)",
             f"{'model':<12}{'pair':>15}{'torch':>15}{'gradring':>15}{'view':>15}"
             f"{'ovh torch':>15}{'ovh gradring':>15}{'ovh ratio':>11}{'vs median pair':>16}"
             f"{'vs rank0 pair':>15}"]
    notes = []
    for name, res in results.items():
        fig = {k: figure(v) for k, v in res.items() if not k.startswith("_")}
        ot, og = effect(res["pair"], res["torch"]), effect(res["pair"], res["gradring"])
        verdict = ratio(og, ot, ("gradring", "torch"))
        older = [ratio(effect(base, res["gradring"]), effect(base, res["torch"]),
                       ("gradring", "torch"))
                 for base in (res.get("_pair_median", res["pair"]), res["_pair_rank0"])]
        lines.append(
            f"{name:<12}"
            # Every figure cell is a space and then the figure: never two run together.
            + "".join(f" {v!s:>14}" for v in (fig['pair'], fig['torch'], fig['gradring'],
                                               fig['gradring_view'], ot, og))
            + f"{verdict.cell(11)}{older[0].cell(16)}{older[1].cell(15)}")
        if verdict.problem:
            notes.append(f"{name}: no overhead ratio: {verdict.problem}")
    lines += ["", "per parameter and step (overhead / tensors), ratio spread = each round's "
              "overhead ratio, min-max",
              f"{'model':<12}{'tensors':>8}{'ratio':>7}{'spread':>14}{'us torch':>10}"
              f"{'us gradring':>13}{'us notrace':>12}{'trace us':>10}"]
    for name, res in results.items():
        if "_nparams" not in res or "notrace" not in res:
            continue  # rounds recorded without the per-parameter set-ups
        n = res["_nparams"][0]
        med = {k: statistics.median(res[k]) for k in ("pair", "torch", "gradring", "notrace")}
        ot, og = med["torch"] - med["pair"], med["gradring"] - med["pair"]
        on = med["notrace"] - med["pair"]
        per_round = [(g - p) / (t - p) for p, t, g in zip(res["pair"], res["torch"],
                                                          res["gradring"]) if t > p]
        spread = (f"{min(per_round):.2f}-{max(per_round):.2f}" if per_round else "n/a")
        r_med = f"{og / ot:.2f}" if ot > 0 and og >= 0 else "noisy"
        lines.append(f"{name:<12}{n:>8.0f}{r_med:>7}{spread:>14}{ot * 1e3 / n:>10.2f}"
                     f"{og * 1e3 / n:>13.2f}{on * 1e3 / n:>12.2f}{(og - on) * 1e3 / n:>10.2f}")
    lines += ["", "CPU time per step (rank 0's process, all threads: waiting and a loaded "
              "machine's stalls do not count)",
              f"{'model':<12}{'pair':>8}{'torch':>8}{'gradring':>10}{'ovh ratio':>11}"
              f"{'us torch':>10}{'us gradring':>13}"]
    for name, res in results.items():
        if "_nparams" not in res or "_cpu_pair" not in res:
            continue
        n = res["_nparams"][0]
        cpu = {k: statistics.median(res["_cpu_" + k]) for k in ("pair", "torch", "gradring")}
        ot, og = cpu["torch"] - cpu["pair"], cpu["gradring"] - cpu["pair"]
        r_med = f"{og / ot:.2f}" if ot > 0 and og >= 0 else "noisy"
        lines.append(f"{name:<12}{cpu['pair']:>8.1f}{cpu['torch']:>8.1f}{cpu['gradring']:>10.1f}"
                     f"{r_med:>11}{ot * 1e3 / n:>10.2f}{og * 1e3 / n:>13.2f}")
    for name, res in results.items():
        if "_mem" in res:
            out_plain, buck_plain, out_view, buck_view = res["_mem"]
            mib = 2.0**20
            lines.append(
                f"{name}: gradient memory without bucket view "
                f"{(out_plain + buck_plain) / mib:.1f} MiB (private grads {out_plain / mib:.1f} + "
                f"buckets {buck_plain / mib:.1f}); with gradient_as_bucket_view "
                f"{(out_view + buck_view) / mib:.1f} MiB")
    lines += _paired_table(results)
    if notes:
        lines += ["", "NOT TRUSTWORTHY on this machine now (rerun with more --rounds/--steps, "
                  "or on a quieter machine):", *("  " + n for n in notes)]
    return "\n".join(lines)


def _halves(res: dict[str, Any], key: str) -> str:
    """The paired ratio over the first and the second half of the steps: how far the
    figure moved while the bench ran."""
    mine, theirs = paired(res, key), paired(res, "torch")
    if not mine or not theirs or len(mine) < 4:
        return "n/a"
    h = len(mine) // 2
    out = []
    for part in (slice(0, h), slice(h, None)):
        t = statistics.median(theirs[part])
        out.append(f"{statistics.median(mine[part]) / t:.2f}" if t > 0 else "nan")
    return "/".join(out)


def _paired_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Overheads from paired steps (see paired()): the figures to quote on a noisy host."""
    rows = [n for n, res in results.items() if paired(res, "gradring") and paired(res, "torch")]
    if not rows:
        return []
    lines = ["", "paired per step: each DDP step minus the pair step beside it (slower rank "
             "of each), median over every step of the run; halves = the ratio over the "
             "first / second half of the steps",
             f"{'model':<12}{'steps':>6}{'ovh torch':>11}{'ovh gradring':>14}{'ratio':>7}"
             f"{'halves':>11}{'view':>7}"]
    for name in rows:
        res = results[name]
        ot = statistics.median(paired(res, "torch") or [])
        og = statistics.median(paired(res, "gradring") or [])
        view = _paired_ratio(res, "gradring_view")
        lines.append(f"{name:<12}{len(paired(res, 'gradring') or []):>6}{ot:>11.2f}{og:>14.2f}"
                     f"{og / ot if ot > 0 else float('nan'):>7.2f}"
                     f"{_halves(res, 'gradring'):>11}"
                     f"{view if view is not None else float('nan'):>7.2f}")
    return lines


def measure(nproc: int = 2, models: list[str] | None = None, steps: int = 5,
            rounds: int = 5, *, load: int = 0,
            extra_setups: dict[str, SetupFactory] | None = None,
            probe: ModelProbe | None = None) -> dict[str, dict[str, list[float]]]:
    """Run the bench's rounds on ``nproc`` fresh rank processes and return, per
    model, the slowest rank's figures (the input of :func:`report`).

    ``extra_setups`` are stepped beside the bench's own set-ups, in the same
    shuffled turns; ``probe`` runs after each model's rounds (see SetupFactory
    and ModelProbe). ``load`` CPU-spinning processes run beside the ranks."""
    from gradring.tools.bench.load import competing_load
    from gradring.tools.bench.ranks import run_ranks

    models = list(models) if models is not None else list(MODELS)
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {list(MODELS)}")
    extra = dict(extra_setups or {})
    taken = set(BASE_SETUPS)
    clash = sorted(k for k in extra if k in taken or k.startswith("_"))
    if clash:
        raise ValueError(f"extra set-ups {clash} clash with the bench's own names "
                         f"{sorted(taken)} (or start with '_')")
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    args = argparse.Namespace(models=models, steps=steps, rounds=rounds,
                              extra_setups=extra, probe=probe)
    with competing_load(load):
        per_rank = dict(run_ranks(worker, nproc, (args,), results=nproc))
    return _slowest([per_rank[r] for r in range(nproc)])


def run(nproc: int = 2, models: list[str] | None = None, steps: int = 5,
        rounds: int = 5, load: int = 0) -> str:
    """Run the bench (see the module docstring) and return its tables."""
    from gradring.tools.bench.load import load_note

    results = measure(nproc, models, steps, rounds, load=load)
    return load_note(load) + report(results, nproc)


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every DDP step bench takes: --nproc, --models, --steps, --rounds,
    --load (read back with :func:`check_run_arguments`)."""
    ap.add_argument("--nproc", type=int, default=2, help="rank processes (default: 2)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                    metavar="MODEL",
                    help=f"models to step, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--steps", type=int, default=5,
                    help="steps of each set-up per round (default: 5)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    ap.add_argument("--load", type=int, default=0, metavar="N",
                    help="run N CPU-spinning processes beside the ranks (default: 0)")


def check_run_arguments(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject values of :func:`add_run_arguments`' options that cannot run (exits
    through ``ap.error`` with the reason)."""
    for name, least in (("nproc", 1), ("steps", 1), ("rounds", 1), ("load", 0)):
        if getattr(a, name) < least:
            ap.error(f"--{name} must be at least {least}, got {getattr(a, name)}")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog or "gradring bench ddp", description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    add_run_arguments(ap)
    a = ap.parse_args(argv)
    check_run_arguments(ap, a)
    print(run(a.nproc, a.models, a.steps, a.rounds, a.load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
