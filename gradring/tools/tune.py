"""``gradring tune``: pick bucket_cap_mb by measuring, then check the pick by running DDP.

    gradring tune mlp                                  # a built-in model, 2 processes
    gradring tune mypkg.models:workload --nproc 2      # your own: returns (model, input, loss_fn)
    gradring tune mlp --caps 1,4,25 --measure-all      # also measure every candidate

[Note: how the tuner decides]
The chapter's rule (its section on tuning bucket_cap_mb) is to time one
bucket's all-reduce against one layer's backward and size buckets from the
ratio. The tuner does exactly that, then simulates the reducer:

1. On every rank at once (so the machine is as loaded as in training), the
   plain model runs a few steps without DDP while post-accumulate-grad hooks
   stamp when each parameter's gradient is ready. This gives the arrival
   order, per-parameter ready times, the backward's length and the step time
   without any communication.
2. All-reduce time against message size, with gradring.comm on the real
   process group, on a ``comm.empty`` buffer (as DDP's buckets are), issued
   asynchronously as the reducer does (engine thread + future):
   ``link_curve.measure_allreduce``, with a barrier before every timed call.
3. For each candidate cap the step model ([Note: the step model] in
   ``gradring/step_model.py``) seals buckets over the arrival order as the
   rebuild does, runs their all-reduces one after another from the measured
   curve, and predicts exposed communication and step time, charging
   buckets x c, where c, the *per-bucket cost*, is what a collective costs
   the backward even when it overlaps (the chapter's "launch overhead"). By
   default c is the measured time of the smallest all-reduce: on one CPU
   host a collective's fixed work is Python on the comm thread of the same
   process (the GIL) and runs on the cores the backward uses, so it is not
   hidden. ``--per-bucket-ms 0`` models a transport whose fixed costs
   overlap perfectly. Where no core is free for the collectives, the model
   is ``bucket_cap_mb="auto"``'s for such a host ([Note: auto on a host with
   no free core] in ``reducer/autocap.py``): nothing overlaps, and the first
   bucket is as large as the others, as it is for the explicit caps step 5
   trains with.
4. The cap is picked by ``autocap.pick``, the rule ``bucket_cap_mb="auto"``
   follows too ([Note: one rule for picking a cap] in ``reducer/autocap.py``):
   the default unless another cap's predicted step is shorter by more than 2%;
   then the smallest predicted step, and among caps within 2% of it the
   largest (fewer collectives: their fixed costs are the part of the model
   least well measured).
5. DDP then really trains with the chosen cap and with the 25 MiB default
   (or every candidate), in rounds interleaved with the plain model, and both
   predicted and measured step times are shown.

The model leaves out what the reducer itself costs per byte (copying each
gradient into its bucket, writing the results back into ``.grad``) and that
the collectives' per-byte work also competes with the backward for cores;
the gap between predicted and measured step time is that cost. See
docs/overlap.md for measured numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from gradring.buckets import DEFAULT_BUCKET_CAP_MB, MIB
from gradring.link_curve import measure_allreduce
from gradring.step_model import (
    DEFAULT_CAPS_MB,
    CommCurve,
    Prediction,
    Profile,
    has_free_core,
    pick,
    predict,
    sweep_sizes,
)
from gradring.tools.workloads import BUILTIN, Workload, forward_loss, from_parts, load_workload


# ------------------------------------------------------------------ measuring (on each rank)
def profile_backward(make: Callable[[], Workload], *, warmup: int = 3,
                     steps: int = 10) -> Profile:
    """When each gradient is ready in a plain (non-DDP) backward: post-accumulate-grad hooks."""
    model, x, loss_fn = make()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stamps = [0.0] * len(named)

    def stamp(i: int) -> Callable[[torch.Tensor], None]:
        return lambda _p: stamps.__setitem__(i, time.perf_counter())

    handles = [p.register_post_accumulate_grad_hook(stamp(i)) for i, (_, p) in enumerate(named)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ready: list[list[float]] = []
    backward, step = [], []
    try:
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = forward_loss(model, x, loss_fn)
            tb = time.perf_counter()
            loss.backward()
            te = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            if k >= warmup:
                ready.append([(s - tb) * 1e3 for s in stamps])
                backward.append((te - tb) * 1e3)
                step.append((t1 - t0) * 1e3)
    finally:
        for h in handles:
            h.remove()
    return Profile(
        names=[n for n, _ in named],
        sizes=[p.numel() * p.element_size() for _, p in named],
        keys=[f"{p.dtype}/{p.device}" for _, p in named],
        ready_ms=[statistics.median(col) for col in zip(*ready)],
        backward_ms=statistics.median(backward),
        step_ms=statistics.median(step),
    )


def measure_ddp(make: Callable[[], Workload], caps_mb: Sequence[float], *, steps: int = 10,
                rounds: int = 3, warmup: int = 3) -> tuple[dict[float, dict[str, Any]], float]:
    """Median step time of gradring DDP at each cap, plus its overlap stats, and of the
    plain model: rounds interleaved, so machine noise hits all set-ups alike."""
    import torch.distributed as dist

    import gradring
    from gradring.observe.overlap import ddp_overlap_stats

    setups: dict[Any, tuple[nn.Module, Any, Any, torch.optim.Optimizer]] = {}
    for key in ["plain", *caps_mb]:
        model, x, loss_fn = make()
        if key != "plain":
            model = gradring.DistributedDataParallel(model, bucket_cap_mb=key)
        setups[key] = (model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=1e-4))
    times: dict[Any, list[float]] = {key: [] for key in setups}
    # Each round's median per set-up: their range is the noise a gain must beat.
    per_round: dict[Any, list[float]] = {key: [] for key in setups}

    def run(key: Any, n: int) -> None:
        model, x, loss_fn, opt = setups[key]
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            forward_loss(model, x, loss_fn).backward()
            opt.step()
            times[key].append((time.perf_counter() - t0) * 1e3)

    for key in setups:
        run(key, warmup)  # includes the bucket rebuild
        times[key].clear()
    for _ in range(rounds):
        for key in setups:
            dist.barrier()
            run(key, steps)
            per_round[key].append(statistics.median(times[key][-steps:]))
    out = {}
    for cap in caps_mb:
        ddp = setups[cap][0]
        stats = ddp_overlap_stats(ddp, last_n=steps)
        out[cap] = {"step_ms": statistics.median(times[cap]), "exposed_ms": stats["exposed_ms"],
                    "buckets": float(len(ddp.reducer.buckets)),
                    "spread_ms": max(per_round[cap]) - min(per_round[cap])}
    return out, statistics.median(times["plain"])


class TuneResult(NamedTuple):
    """What the tuner measured and predicted. ``profile.step_ms`` and every
    ``Prediction.step_ms`` use the plain step measured interleaved with the DDP
    runs, so predicted and measured step times share the machine's conditions."""

    profile: Profile
    curve: CommCurve
    predictions: list[Prediction]
    chosen: Prediction
    default: Prediction
    # cap -> step_ms, exposed_ms, buckets, spread_ms
    measured: dict[float, dict[str, Any]]
    per_bucket_ms: float  # the per-bucket cost c the predictions charged
    why: str = ""         # the step model's pick in words (autocap.pick, as "auto" picks)


def _mean_profile(profiles: Sequence[Profile]) -> Profile:
    p0 = profiles[0]
    mean = statistics.fmean
    return p0._replace(ready_ms=[mean(col) for col in zip(*(p.ready_ms for p in profiles))],
                       backward_ms=mean([p.backward_ms for p in profiles]),
                       step_ms=mean([p.step_ms for p in profiles]))


def tune_rank(rank: int, world: int, workload: str | Callable[[], Workload],
              caps_mb: Sequence[float] = DEFAULT_CAPS_MB, *, steps: int = 10, rounds: int = 3,
              measure_all: bool = False, per_bucket_ms: float | None = None) -> TuneResult | None:
    """What every rank runs inside an initialised process group; rank 0 returns the result."""
    import torch.distributed as dist

    from gradring.group_comm import GroupComm

    make = functools.partial(load_workload, workload)
    dist.barrier()
    mine = profile_backward(make, steps=steps)
    sizes = sweep_sizes(sum(mine.sizes))
    times = measure_allreduce(GroupComm(dist.group.WORLD), sizes, sync=dist.barrier).times_ms
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, times))
    profile = _mean_profile([p for p, _ in everyone])
    # A collective is as slow as its slowest rank.
    curve = CommCurve(sizes, [max(col) for col in zip(*(t for _, t in everyone))])
    caps = sorted(set(caps_mb) | {float(DEFAULT_BUCKET_CAP_MB)})
    c0 = curve.times_ms[0] if per_bucket_ms is None else per_bucket_ms
    # auto's model of the host ([Note: auto on a host with no free core]); the DDP runs
    # below pass explicit caps, and an explicit cap is also the first bucket's.
    free = has_free_core(GroupComm(dist.group.WORLD),
                         [key.split("/")[-1] for key in profile.keys])

    predictions = [predict(profile, curve, c, per_bucket_ms=c0, free_core=free) for c in caps]
    # identical on every rank: same inputs, same arithmetic; the rule of
    # bucket_cap_mb="auto" ([Note: one rule for picking a cap] in reducer/autocap.py)
    chosen = pick(predictions).prediction
    default = next(p for p in predictions if p.cap_mb == DEFAULT_BUCKET_CAP_MB)
    to_measure = caps if measure_all else sorted({chosen.cap_mb, default.cap_mb})
    measured, plain_ms = measure_ddp(make, to_measure, steps=steps, rounds=rounds)
    if rank != 0:
        return None
    profile = profile._replace(step_ms=plain_ms)
    predictions = [predict(profile, curve, c, per_bucket_ms=c0, free_core=free) for c in caps]
    by_cap = {p.cap_mb: p for p in predictions}
    return TuneResult(profile, curve, predictions, by_cap[chosen.cap_mb],
                      by_cap[default.cap_mb], measured, c0, pick(predictions).why)


def tune_bucket_cap(model_fn: Callable[[], nn.Module] | None = None,
                    input_fn: Callable[[], Any] | None = None,
                    loss_fn: Callable[[Any], torch.Tensor] | None = None, nproc: int = 2, *,
                    workload: str | Callable[[], Workload] | None = None,
                    caps_mb: Sequence[float] = DEFAULT_CAPS_MB, steps: int = 10,
                    rounds: int = 3, measure_all: bool = False,
                    per_bucket_ms: float | None = None) -> TuneResult:
    """Measure, predict and check bucket_cap_mb on ``nproc`` fresh local processes.

    Give either ``model_fn, input_fn, loss_fn`` (module-level functions: they
    travel to the rank processes by name; ``loss_fn(output) -> scalar``) or
    ``workload`` (a built-in name, ``module:function`` or a picklable callable
    returning ``(model, input, loss_fn)``). ``per_bucket_ms`` is the cost c of
    [Note: how the tuner decides] (None: the measured smallest all-reduce).
    """
    from gradring.tools.launch import run_local

    if workload is None:
        if model_fn is None or input_fn is None or loss_fn is None:
            raise ValueError("give model_fn, input_fn and loss_fn, or workload")
        workload = functools.partial(from_parts, model_fn, input_fn, loss_fn)
    results = run_local(_tune_entry, nproc, workload, tuple(caps_mb), steps, rounds,
                        measure_all, per_bucket_ms)
    return results[0]


def _tune_entry(rank: int, world: int, workload: Any, caps: tuple[float, ...], steps: int,
                rounds: int, measure_all: bool, per_bucket_ms: float | None) -> TuneResult | None:
    return tune_rank(rank, world, workload, caps, steps=steps, rounds=rounds,
                     measure_all=measure_all, per_bucket_ms=per_bucket_ms)


# ------------------------------------------------------------------ reporting
def _size(n: float) -> str:
    return f"{n / MIB:.3g} MiB" if n >= MIB else f"{n / 1024:.3g} KiB"


def report(r: TuneResult, *, nproc: int, name: str = "") -> str:
    p = r.profile
    total = sum(p.sizes)
    lines = [
        f"gradring tune{': ' + name if name else ''}: {nproc} processes, {len(p.sizes)} "
        f"parameters, {_size(total)} of gradients",
        f"plain model: backward {p.backward_ms:.1f} ms, step {p.step_ms:.1f} ms "
        f"(no communication); per-bucket cost charged: {r.per_bucket_ms:.2f} ms",
        "all-reduce: " + " | ".join(f"{_size(s)} {t:.2f} ms"
                                    for s, t in zip(r.curve.sizes, r.curve.times_ms)),
        f"{'cap MiB':>8} {'buckets':>8} {'last bucket':>12} {'pred exposed':>13} "
        f"{'pred step':>10}",
    ]
    for q in r.predictions:
        last = sum(p.sizes[i] for i in q.buckets[-1]) if q.buckets else 0
        mark = " <- chosen" if q is r.chosen else (" (default)" if q is r.default else "")
        lines.append(f"{q.cap_mb:>8g} {len(q.buckets):>8} {_size(last):>12} "
                     f"{q.exposed_ms:>10.2f} ms {q.step_ms:>7.1f} ms{mark}")
    lines.append(f"{'':>8} {'pred step':>10} {'measured':>10} {'pred exposed':>13} "
                 f"{'meas exposed':>13} {'buckets':>8}")
    for q in r.predictions:
        m = r.measured.get(q.cap_mb)
        if m is None:
            continue
        tag = "chosen" if q is r.chosen else ("default" if q is r.default else "")
        lines.append(f"cap {q.cap_mb:<5g}{tag:>8} {q.step_ms:>7.1f} ms {m['step_ms']:>7.1f} ms "
                     f"{q.exposed_ms:>10.2f} ms {m['exposed_ms']:>10.2f} ms {int(m['buckets']):>8}")
    same = [q.cap_mb for q in r.predictions if q.buckets == r.default.buckets]
    if len(same) > 1:
        lines.append(f"caps {', '.join(f'{c:g}' for c in same)} MiB all give the same "
                     f"{len(r.default.buckets)} bucket(s): they cannot differ")
    if r.why:
        lines.append(f"step model's pick (the rule bucket_cap_mb='auto' follows): {r.why}")
    lines.append(recommendation(r))
    return "\n".join(lines)


def recommendation(r: TuneResult) -> str:
    """The verdict line: a cap other than the default only for a measured gain
    beyond the round-to-round spread of both measurements."""
    if r.chosen.buckets == r.default.buckets:
        return f"recommendation: keep the default (bucket_cap_mb={DEFAULT_BUCKET_CAP_MB})"
    c, d = r.measured[r.chosen.cap_mb], r.measured[r.default.cap_mb]
    gain = d["step_ms"] - c["step_ms"]
    noise = max(c.get("spread_ms", 0.0), d.get("spread_ms", 0.0))
    if gain > noise:
        return (f"recommendation: bucket_cap_mb={r.chosen.cap_mb:g}: measured "
                f"{c['step_ms'] / d['step_ms']:.3f}x the default's step time, a gain of "
                f"{gain:.2f} ms beyond the rounds' spread of {noise:.2f} ms")
    return (f"recommendation: keep the default (bucket_cap_mb={DEFAULT_BUCKET_CAP_MB}): "
            f"bucket_cap_mb={r.chosen.cap_mb:g} measured {c['step_ms'] / d['step_ms']:.3f}x, "
            f"a difference of {gain:+.2f} ms within the rounds' spread of {noise:.2f} ms. "
            f"bucket_cap_mb='auto' cannot train twice to check: it decides by the step "
            f"model alone and would take {r.chosen.cap_mb:g} MiB on timings like these")


def _as_json(r: TuneResult) -> dict[str, Any]:
    return {"profile": r.profile._asdict(), "curve": r.curve._asdict(),
            "predictions": [q._asdict() for q in r.predictions],
            "chosen_cap_mb": r.chosen.cap_mb, "per_bucket_ms": r.per_bucket_ms,
            "measured": {str(k): v for k, v in r.measured.items()}}


def parser() -> argparse.ArgumentParser:
    """``gradring tune``'s command line."""
    from gradring.tools.helpfmt import command_parser

    ap = command_parser(
        "gradring tune",
        "Pick bucket_cap_mb for your model on this machine. On several local processes "
        "it times your model's backward and the all-reduce at several sizes, predicts "
        "each candidate cap's step time from them, then trains DDP at the predicted "
        "best cap and at the default (25 MiB) and recommends a different cap only when "
        "it measured faster beyond the run-to-run noise. The prediction follows the "
        "same rule as bucket_cap_mb='auto'; the report says when the measurement "
        "overrules it.",
        [("gradring tune mlp", "a built-in model on 2 processes"),
         ("gradring tune mypkg.models:workload --nproc 4",
          "your own model: a function returning (model, input, loss_fn)"),
         ("gradring tune mlp --caps 1,4,25 --measure-all",
          "measure every candidate cap, not only the pick and the default")],
        f"Built-in models: {', '.join(BUILTIN)}. How the tuner decides is described in "
        "gradring/tools/tune.py and docs/overlap.md.")
    ap.add_argument("workload", help=f"a built-in model ({', '.join(BUILTIN)}) or "
                                     "module:function returning (model, input, loss_fn)")
    ap.add_argument("--nproc", type=int, default=2, metavar="N", help="local processes")
    ap.add_argument("--caps", default=",".join(f"{c:g}" for c in DEFAULT_CAPS_MB),
                    metavar="LIST",
                    help="candidate caps in MiB, comma-separated; 25 is always added")
    ap.add_argument("--steps", type=int, default=10, metavar="N",
                    help="training steps per measurement round")
    ap.add_argument("--rounds", type=int, default=3, metavar="N",
                    help="measurement rounds, the set-ups taking turns")
    ap.add_argument("--measure-all", action="store_true",
                    help="train DDP at every candidate cap, not only the pick and the default")
    ap.add_argument("--per-bucket-ms", type=float, default=None, metavar="MS",
                    help="what one all-reduce costs the backward even when it overlaps "
                         "(default: the measured time of the smallest all-reduce; 0: no "
                         "such cost)")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="also write the measurements and predictions here (default: none)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    # As `python -m` does: a workload in the current folder imports, here and
    # in the rank processes (which inherit PYTHONPATH).
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [cwd] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    caps = [float(c) for c in a.caps.split(",") if c.strip()]
    if a.json:
        from gradring.safe_files import check_output

        try:
            check_output(a.json)  # refuse a planted link before the long measurement
        except OSError as exc:
            print(f"gradring tune: {exc}", file=sys.stderr)
            return 2
    r = tune_bucket_cap(nproc=a.nproc, workload=a.workload, caps_mb=caps, steps=a.steps,
                        rounds=a.rounds, measure_all=a.measure_all,
                        per_bucket_ms=a.per_bucket_ms)
    print(report(r, nproc=a.nproc, name=a.workload))
    if a.json:
        from gradring.safe_files import open_output

        with open_output(a.json, "w") as f:  # never through a link planted there
            json.dump(_as_json(r), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
