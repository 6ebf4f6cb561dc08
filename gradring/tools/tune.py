"""``gradring tune``: pick bucket_cap_mb by measuring, then check the pick by running DDP.

    gradring tune mlp                                  # a built-in model, 2 processes
    gradring tune mypkg.models:workload --nproc 2      # your own: returns (model, input, loss_fn)
    gradring tune mlp --caps 1,4,25 --measure-all      # also measure every candidate

[Note: how the tuner decides]
The chapter's rule (§17.39) is to time one bucket's all-reduce against one
layer's backward and size buckets from the ratio. The tuner does exactly
that, then simulates the reducer:

1. On every rank at once (so the machine is as loaded as in training), the
   plain model runs a few steps without DDP while post-accumulate-grad hooks
   stamp when each parameter's gradient is ready. This gives the arrival
   order, per-parameter ready times, the backward's length and the step time
   without any communication.
2. All-reduce time against message size, with gradring.comm on the real
   process group, on a ``comm.empty`` buffer (as DDP's buckets are), issued
   asynchronously as the reducer does (engine thread + future).
3. For each candidate cap: buckets are sealed by ``assign_buckets`` over the
   arrival order with caps [1 MiB, cap] (what the rebuild does); bucket k
   launches when all its gradients are ready and bucket k-1 has launched; its
   collective starts when bucket k-1's finished and lasts T(bytes) from the
   measured curve. Predicted exposed = max(0, last done - end of backward);
   predicted step = step without DDP + predicted exposed + buckets x c, where
   c, the *per-bucket cost*, is what a collective costs the backward even when
   it overlaps (§17.38's "launch overhead"). By default c is the measured time
   of the smallest all-reduce: on one CPU host a collective's fixed work is
   Python on the comm thread of the same process (the GIL) and runs on the
   cores the backward uses, so it is not hidden. ``--per-bucket-ms 0`` models
   a transport whose fixed costs overlap perfectly.
4. The cap with the smallest predicted step wins; among caps within 2% of the
   best, the largest is taken (fewer collectives: their fixed costs are the
   part of the model least well measured).
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
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from gradring.buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, assign_buckets

DEFAULT_CAPS_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100)
TIE_TOLERANCE = 0.02  # see step 4 of [Note: how the tuner decides]

Workload = tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]


# ------------------------------------------------------------------ built-in workloads
def mlp(batch: int = 32) -> Workload:
    """12 x Linear(1024, 1024): 48 MiB of gradients in equal 4 MiB layers, batch 32."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(batch, 1024), lambda out: out.pow(2).mean()


def mlp_b1() -> Workload:
    """``mlp`` at batch 1: a backward about as short as its 48 MiB all-reduce."""
    return mlp(1)


def wide_mlp() -> Workload:
    """4 x Linear(2048, 2048) at batch 8: 64 MiB of gradients, little compute per byte."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(8, 2048), lambda out: out.pow(2).mean()


def deep_mlp() -> Workload:
    """48 x Linear(512, 512) at batch 8: 48 MiB of gradients in 1 MiB layers, a short backward."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(8, 512), lambda out: out.pow(2).mean()


def tiny() -> Workload:
    """4 x Linear(256, 256): for tests (1 MiB of gradients)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(16, 256), lambda out: out.pow(2).mean()


BUILTIN: dict[str, Callable[[], Workload]] = {
    "mlp": mlp, "mlp_b1": mlp_b1, "wide_mlp": wide_mlp, "deep_mlp": deep_mlp, "tiny": tiny}


def _from_parts(model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any],
                loss_fn: Callable[[Any], torch.Tensor]) -> Workload:
    return model_fn(), input_fn(), loss_fn


def load_workload(spec: str | Callable[[], Workload]) -> Workload:
    """A built-in name, ``module:function`` or a callable, each giving (model, input, loss_fn)."""
    if callable(spec):
        return spec()
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise ValueError(f"unknown workload {spec!r}: use one of {sorted(BUILTIN)} "
                         "or module:function")
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def _forward_loss(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor]) -> Any:
    out = model(*x) if isinstance(x, tuple) else model(x)
    return loss_fn(out)


# ------------------------------------------------------------------ the model of a step
class Profile(NamedTuple):
    """One backward of the plain model, as the tuner measured it."""

    names: list[str]
    sizes: list[int]          # gradient bytes per parameter (definition order)
    keys: list[str]           # dtype/device: parameters with different keys never share a bucket
    ready_ms: list[float]     # when each gradient was ready, ms after backward() was called
    backward_ms: float        # backward() call to return
    step_ms: float            # whole step without DDP: zero_grad, forward, backward, optimizer


class CommCurve(NamedTuple):
    """Measured all-reduce time against message size; piecewise linear in between."""

    sizes: list[int]
    times_ms: list[float]

    def time_ms(self, nbytes: int) -> float:
        xs, ys = self.sizes, self.times_ms
        if nbytes <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if nbytes <= x1:
                return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
        if len(xs) == 1:
            return ys[0] * nbytes / xs[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])  # extrapolate the last segment
        return ys[-1] + slope * (nbytes - xs[-1])


class Prediction(NamedTuple):
    cap_mb: float
    buckets: list[list[int]]  # parameter indices, in launch order
    exposed_ms: float
    step_ms: float
    done_ms: list[float]      # when each bucket's all-reduce would finish (ms after backward())


def simulate(profile: Profile, curve: CommCurve, cap_mb: float, *, per_bucket_ms: float = 0.0,
             first_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES) -> Prediction:
    """Predict exposed communication and step time for one cap ([Note: how the tuner decides])."""
    order = sorted(range(len(profile.sizes)), key=lambda i: (profile.ready_ms[i], i))
    groups = assign_buckets(profile.sizes, [first_cap_bytes, int(cap_mb * MIB)],
                            keys=profile.keys, order=order)
    launched = done = float("-inf")
    finishes = []
    for group in groups:
        ready = max(profile.ready_ms[i] for i in group)
        launched = max(launched, ready)
        start = max(launched, done)
        done = start + curve.time_ms(sum(profile.sizes[i] for i in group))
        finishes.append(done)
    exposed = max(0.0, done - profile.backward_ms) if groups else 0.0
    step = profile.step_ms + exposed + per_bucket_ms * len(groups)
    return Prediction(cap_mb, groups, exposed, step, finishes)


def choose(predictions: Sequence[Prediction], tolerance: float = TIE_TOLERANCE) -> Prediction:
    """The smallest predicted step; among those within ``tolerance`` of it, the largest cap."""
    best = min(p.step_ms for p in predictions)
    near = [p for p in predictions if p.step_ms <= best * (1 + tolerance)]
    return max(near, key=lambda p: p.cap_mb)


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
            loss = _forward_loss(model, x, loss_fn)
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


def sweep_sizes(total_bytes: int, smallest: int = 4096) -> list[int]:
    """Message sizes for the all-reduce curve: powers of two up to the whole model."""
    sizes, s = [], smallest
    while s * 1.25 < total_bytes:  # no power of two right next to the total
        sizes.append(s)
        s *= 2
    return sizes + [max(total_bytes, smallest)]


def measure_allreduce(sizes: Sequence[int], *, budget_bytes: int = 64 * MIB) -> list[float]:
    """Median ms of one asynchronous all-reduce per size (float32), on a comm.empty buffer."""
    import torch.distributed as dist

    from gradring.group_comm import GroupComm

    comm = GroupComm(dist.group.WORLD)
    buf = comm.empty(max(sizes) // 4 + 1, torch.float32, torch.device("cpu"))
    buf.zero_()
    out = []
    for size in sizes:
        view = buf.narrow(0, 0, max(1, size // 4))
        comm.all_reduce(view).wait()  # warm-up (and first-touch of the pages)
        reps = max(3, min(20, budget_bytes // max(size, 1)))
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            comm.all_reduce(view).wait()
            times.append((time.perf_counter() - t) * 1e3)
        out.append(statistics.median(times))
    return out


def measure_ddp(make: Callable[[], Workload], caps_mb: Sequence[float], *, steps: int = 10,
                rounds: int = 3, warmup: int = 3) -> tuple[dict[float, dict[str, float]], float]:
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

    def run(key: Any, n: int) -> None:
        model, x, loss_fn, opt = setups[key]
        for _ in range(n):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _forward_loss(model, x, loss_fn).backward()
            opt.step()
            times[key].append((time.perf_counter() - t0) * 1e3)

    for key in setups:
        run(key, warmup)  # includes the bucket rebuild
        times[key].clear()
    for _ in range(rounds):
        for key in setups:
            dist.barrier()
            run(key, steps)
    out = {}
    for cap in caps_mb:
        ddp = setups[cap][0]
        stats = ddp_overlap_stats(ddp, last_n=steps)
        out[cap] = {"step_ms": statistics.median(times[cap]), "exposed_ms": stats["exposed_ms"],
                    "buckets": float(len(ddp.reducer.buckets))}
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
    measured: dict[float, dict[str, float]]  # cap -> step_ms, exposed_ms, buckets
    per_bucket_ms: float  # the per-bucket cost c the predictions charged


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

    make = functools.partial(load_workload, workload)
    dist.barrier()
    mine = profile_backward(make, steps=steps)
    sizes = sweep_sizes(sum(mine.sizes))
    times = measure_allreduce(sizes)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (mine, times))
    profile = _mean_profile([p for p, _ in everyone])
    # A collective is as slow as its slowest rank.
    curve = CommCurve(sizes, [max(col) for col in zip(*(t for _, t in everyone))])
    caps = sorted(set(caps_mb) | {float(DEFAULT_BUCKET_CAP_MB)})
    c0 = curve.times_ms[0] if per_bucket_ms is None else per_bucket_ms
    predictions = [simulate(profile, curve, c, per_bucket_ms=c0) for c in caps]
    chosen = choose(predictions)  # identical on every rank: same inputs, same arithmetic
    default = next(p for p in predictions if p.cap_mb == DEFAULT_BUCKET_CAP_MB)
    to_measure = caps if measure_all else sorted({chosen.cap_mb, default.cap_mb})
    measured, plain_ms = measure_ddp(make, to_measure, steps=steps, rounds=rounds)
    if rank != 0:
        return None
    profile = profile._replace(step_ms=plain_ms)
    predictions = [simulate(profile, curve, c, per_bucket_ms=c0) for c in caps]
    by_cap = {p.cap_mb: p for p in predictions}
    return TuneResult(profile, curve, predictions, by_cap[chosen.cap_mb],
                      by_cap[default.cap_mb], measured, c0)


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
        workload = functools.partial(_from_parts, model_fn, input_fn, loss_fn)
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
    if r.chosen.cap_mb != r.default.cap_mb:
        c, d = r.measured[r.chosen.cap_mb], r.measured[r.default.cap_mb]
        lines.append(f"measured: bucket_cap_mb={r.chosen.cap_mb:g} takes "
                     f"{c['step_ms'] / d['step_ms']:.3f}x the default's step time")
    else:
        lines.append("the default (25 MiB) is already the best predicted cap")
    return "\n".join(lines)


def _as_json(r: TuneResult) -> dict[str, Any]:
    return {"profile": r.profile._asdict(), "curve": r.curve._asdict(),
            "predictions": [q._asdict() for q in r.predictions],
            "chosen_cap_mb": r.chosen.cap_mb, "per_bucket_ms": r.per_bucket_ms,
            "measured": {str(k): v for k, v in r.measured.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gradring tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", help=f"built-in ({', '.join(BUILTIN)}) or module:function "
                                     "returning (model, input, loss_fn)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--caps", default=",".join(f"{c:g}" for c in DEFAULT_CAPS_MB),
                    help="candidate caps in MiB, comma-separated (25 is always added)")
    ap.add_argument("--steps", type=int, default=10, help="steps per measurement round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved DDP rounds")
    ap.add_argument("--measure-all", action="store_true",
                    help="run DDP at every candidate cap, not only the chosen and the default")
    ap.add_argument("--per-bucket-ms", type=float, default=None,
                    help="cost of one collective the backward cannot hide (default: the "
                         "measured smallest all-reduce; 0: fixed costs overlap perfectly)")
    ap.add_argument("--json", default=None, help="also write the raw result here")
    a = ap.parse_args(argv)
    caps = [float(c) for c in a.caps.split(",") if c.strip()]
    r = tune_bucket_cap(nproc=a.nproc, workload=a.workload, caps_mb=caps, steps=a.steps,
                        rounds=a.rounds, measure_all=a.measure_all,
                        per_bucket_ms=a.per_bucket_ms)
    print(report(r, nproc=a.nproc, name=a.workload))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(_as_json(r), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
