"""The findings of a profiled DDP run, each with a saving from the step model fitted to it.

Pure: over a ``TraceModel`` (``read_profiler``) and the rows ``analysis`` cut.

[Note: the fitted step model]
``step_model``'s model (the one behind ``bucket_cap_mb="auto"`` and ``gradring
tune``) is fitted to the trace before it predicts anything:

1. the profile: each gradient's bytes and ready time after the backward's start
   (the ``AccumulateGrad`` events, medians over the kept steps); the step
   without exposed communication (the measured step less its exposed comm, the
   part spent waiting for peers left in: no bucket change removes it); the
   measured backward;
2. the curve: all-reduce time = a + b x bytes, least squares over this run's
   own bucket collectives (each one's time from when it could start, the later
   of its launch and the previous one's end, to its end). With one bucket size
   the latency a is not measurable and the curve is b x bytes;
3. the fit: one factor s on the curve, found by bisection so that the
   model, run on the bucket layout the run had, predicts the exposed comm the
   run measured. The model then reproduces the measured step. Where no s
   does (more exposed time than any curve gives, or no gradient sizes in the
   trace), explain says the model cannot be fitted and gives no bucket finding.

A cap is then picked by ``step_model.pick`` over ``DEFAULT_CAPS_MB``, the rule auto and
tune use. A bucket-cap finding is given when the picked layout differs from the
run's. At the cap it recommends the fitted model predicts the run's own
layout, so a trace taken there refits to the same s and picks the same cap:
explain recommends no other value of that setting.

A finding is given only when its saving exceeds the spread of the measured
steps (their interquartile range, or their range with fewer than 4 steps):
a smaller saving could not be told from noise, and a note says so.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from typing import NamedTuple

from gradring.buckets import DEFAULT_FIRST_BUCKET_BYTES, MIB
from gradring.step_model import (
    DEFAULT_CAPS_MB,
    CommCurve,
    Prediction,
    Profile,
    pick,
    simulate,
    simulate_groups,
)
from gradring.tools.trace_model import MIN_SAVING_FRACTION, MIN_SAVING_MS, Finding, TraceModel

#: How far the fitted model may miss the measured exposed comm (ms) and still count as fitted.
FIT_TOLERANCE_MS = 0.05
#: The bisection's bounds for the curve's factor.
MAX_SCALE = 1e3


class Fit(NamedTuple):
    """The step model fitted to one rank's trace ([Note: the fitted step model])."""

    profile: Profile
    curve: CommCurve         # the fitted curve (already scaled)
    scale: float
    groups: list[list[int]]  # the run's bucket layout, parameter indices
    measured_step_ms: float
    measured_exposed_ms: float
    current: Prediction
    how: str                 # the curve's origin, in words


def spread_ms(steps: Sequence[float]) -> float:
    """The spread of the measured steps: their interquartile range (their range under 4)."""
    if len(steps) < 2:
        return 0.0
    if len(steps) < 4:
        return max(steps) - min(steps)
    q = statistics.quantiles(steps, n=4)
    return q[2] - q[0]


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _line(points: Sequence[tuple[int, float]]) -> tuple[float, float, str]:
    """a, b of time = a + b x bytes by least squares (a >= 0, b > 0)."""
    xs = [float(n) for n, _ in points]
    ys = [t for _, t in points]
    if len(set(xs)) < 2:
        b = sum(ys) / sum(xs)
        return 0.0, b, "one bucket size: time taken as proportional to bytes"
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if b <= 0:
        return my, 1e-12, "times do not grow with bytes here: a flat curve"
    a = max(0.0, my - b * mx)
    return a, b, f"{len(points)} collectives, {a:.3f} ms + {b * MIB:.3f} ms/MiB"


def curve_of(a: float, b: float, total: int) -> CommCurve:
    """The curve a + b x bytes as ``step_model.CommCurve`` points, up to ``total``."""
    top = max(total, 2)
    return CommCurve([1, top], [a + b, a + b * top])


def fit_rank(model: TraceModel, rank: int, kept: Sequence[int],
             rows: dict[int, dict[str, float]]) -> Fit | str:
    """[Note: the fitted step model] for one rank; a reason (str) where it cannot fit."""
    steps = [st for st in model.ranks[rank].steps if st.number in kept]
    if not steps:
        return "no step to fit to"
    counts = {len(st.grads) for st in steps}
    if len(counts) != 1 or not steps[0].grads:
        return ("the trace holds no gradient sizes (record the profile with "
                "record_shapes=True)")
    n = counts.pop()
    sizes = [steps[0].grads[i].nbytes for i in range(n)]
    ready = [_median([(st.grads[i].ready_us - st.backward_start_us) / 1e3 for st in steps])
             for i in range(n)]
    bsteps = [st for st in steps if st.buckets and all(b.nbytes for b in st.buckets)]
    if not bsteps:
        return "the trace gives no bucket sizes"
    # the run's layout: parameters in ready order, filled into buckets of the measured bytes
    order = sorted(range(n), key=lambda i: (ready[i], i))
    groups: list[list[int]] = []
    it = iter(order)
    for b in bsteps[0].buckets:
        g: list[int] = []
        got = 0
        while got < (b.nbytes or 0):
            i = next(it, None)
            if i is None:
                break
            g.append(i)
            got += sizes[i]
        if g:
            groups.append(g)
    rest = list(it)
    if rest:
        groups.append(rest)
    # the curve from this run's own collectives
    points = []
    for st in bsteps:
        prev = float("-inf")
        for b in st.buckets:
            if b.done_us is None:
                continue
            start = max(b.launch_us, prev)
            points.append((int(b.nbytes or 0), max(1e-3, (b.done_us - start) / 1e3)))
            prev = b.done_us
    if not points:
        return "the trace gives no collective's end"
    a, b, how = _line(points)
    r = [rows[st.number] for st in steps]
    step = _median([x["step"] for x in r])
    exposed = _median([x["last_bucket"] + x["earlier_buckets"] for x in r])
    backward = _median([x["backward"] for x in r])
    base = step - exposed
    total = sum(sizes)

    def predicted(scale: float) -> Prediction:
        prof = Profile([f"grad{i}" for i in range(n)], sizes, ["g"] * n, ready, backward, base)
        return simulate_groups(prof, curve_of(a * scale, b * scale, total), groups)

    lo, hi = 0.0, 1.0
    while predicted(hi).exposed_ms < exposed and hi < MAX_SCALE:
        hi *= 2
    if predicted(hi).exposed_ms + FIT_TOLERANCE_MS < exposed:
        return (f"no curve reproduces the measured {exposed:.2f} ms/step of exposed comm "
                "with the run's buckets")
    if exposed <= FIT_TOLERANCE_MS:
        # nothing exposed: every scale up to the one that starts exposing fits; keep the
        # measured curve where it fits, else the largest that fits
        scale = 1.0 if predicted(1.0).exposed_ms <= FIT_TOLERANCE_MS else 0.0
        if scale == 0.0:
            lo, hi = 0.0, 1.0
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if predicted(mid).exposed_ms <= FIT_TOLERANCE_MS else (lo, mid)
            scale = lo
    else:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if predicted(mid).exposed_ms < exposed else (lo, mid)
        scale = (lo + hi) / 2
    prof = Profile([f"grad{i}" for i in range(n)], sizes, ["g"] * n, ready, backward, base)
    curve = curve_of(a * scale, b * scale, total)
    current = simulate_groups(prof, curve, groups)
    if abs(current.step_ms - step) > max(FIT_TOLERANCE_MS, 0.01 * step):
        return (f"the fitted model predicts {current.step_ms:.2f} ms against the measured "
                f"{step:.2f} ms")
    return Fit(prof, curve, scale, groups, step, exposed, current,
               f"{how}; scaled x{scale:.2f} to reproduce the measured exposed comm")


def predict_cap(fit: Fit, cap_mb: float, first_bytes: int) -> Prediction:
    """The fitted model at ``cap_mb`` with a first bucket of ``first_bytes``."""
    return simulate(fit.profile, fit.curve, cap_mb, first_cap_bytes=first_bytes)


def recommend_cap(fit: Fit, ddp: str) -> tuple[Prediction, str] | None:
    """The cap ``step_model.pick`` takes over the fitted model, when its layout differs
    from the run's (None: the run already has the picked layout)."""
    preds = []
    for cap in DEFAULT_CAPS_MB:
        # torch keeps a 1 MiB first bucket only at its default cap
        first = DEFAULT_FIRST_BUCKET_BYTES if (ddp == "gradring" or cap == 25) \
            else int(cap * MIB)
        preds.append(predict_cap(fit, cap, min(first, int(cap * MIB))))
    chosen = pick(preds)
    best = chosen.prediction
    if sorted(map(sorted, best.buckets)) == sorted(map(sorted, fit.groups)) or \
            best.step_ms >= fit.current.step_ms:
        return None  # the run has the pick's layout, or one the model predicts no slower
    return best, chosen.why


#: ``gradring bench allreduce``'s table rows: size, unit, variant, time (us).
_BENCH_ROW = re.compile(r"^\s*([0-9.]+)\s*(B|KiB|MiB|GiB)\s+(.+?)\s{2,}([0-9.]+)\s")
_UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
#: The variants compared: what gradring's DDP uses for its buckets, and gloo's own.
GRADRING_VARIANT = "gradring-shm (comm.empty)"
GLOO_VARIANT = "gloo native"


def parse_link_curve(text: str) -> dict[int, tuple[float, float]]:
    """bytes -> (gradring's all-reduce us, gloo's) from ``gradring bench allreduce``'s
    printed table; {} when the text holds no such rows."""
    got: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        m = _BENCH_ROW.match(line)
        if m:
            size = int(float(m.group(1)) * _UNITS[m.group(2)])
            got.setdefault(size, {})[m.group(3).strip()] = float(m.group(4))
    return {n: (v[GRADRING_VARIANT], v[GLOO_VARIANT]) for n, v in sorted(got.items())
            if GRADRING_VARIANT in v and GLOO_VARIANT in v and v[GLOO_VARIANT] > 0}


def _ratio(link: dict[int, tuple[float, float]], nbytes: int) -> float:
    """gradring's time over gloo's at ``nbytes``, from the nearest measured sizes."""
    sizes = sorted(link)
    near = min(sizes, key=lambda n: abs(math.log(max(n, 1)) - math.log(max(nbytes, 1))))
    g, t = link[near]
    return g / t


def _gradring_finding(fit: Fit, link: dict[int, tuple[float, float]]) -> Finding | None:
    total = sum(fit.profile.sizes)
    sizes = sorted({int(sum(fit.profile.sizes[i] for i in g)) for g in fit.groups} |
                   {1, total})
    curve = CommCurve(sizes, [fit.curve.time_ms(n) * _ratio(link, n) for n in sizes])
    pred = simulate_groups(fit.profile, curve, fit.groups)
    saving = fit.current.step_ms - pred.step_ms
    ratios = ", ".join(f"{n / MIB:g} MiB x{g / t:.2f}" for n, (g, t) in link.items())
    return Finding(
        "gradring_collectives", "gradring's shared-memory collectives on this host "
        "(a prediction)", "use gradring.DistributedDataParallel, a drop-in replacement for "
        "torch's (its all-reduce goes through shared memory between the ranks of a host)",
        saving,
        f"prediction, not a measurement: the fitted model with each bucket's all-reduce "
        f"scaled by gradring's time over gloo's on this host's link curve ({ratios}, "
        f"measured by `gradring bench allreduce`) predicts {pred.step_ms:.2f} ms/step "
        f"against {fit.current.step_ms:.2f} (events: the bucket all-reduces)")


def _row_spread(rows: dict[int, dict[str, float]], kept: Sequence[int], key: str) -> float:
    if key == "find_unused":
        return spread_ms([rows[n]["post_forward"] + rows[n].get("unused_map", 0.0)
                          for n in kept if n in rows])
    return spread_ms([rows[n][key] for n in kept if n in rows])


#: Findings whose saving is a row measured directly (removing it costs nothing): judged
#: against that row's own spread over the steps, not the model's.
MEASURED = {"find_unused": "find_unused", "forward_sync_buffers": "pre_forward",
            "bucket_view": "copy"}


def _worth(saving: float, step: float, spread: float) -> bool:
    return saving >= max(MIN_SAVING_MS, MIN_SAVING_FRACTION * step) and saving > spread


def profile_findings(model: TraceModel, parts: dict[int, dict[str, float]],
                     rows: dict[int, dict[int, dict[str, float]]], kept: Sequence[int],
                     *, keep_noisy: bool = False, link: dict[int, tuple[float, float]] | None
                     = None) -> tuple[list[Finding], list[str]]:
    """The findings of a profiled run, and notes ([Note: the fitted step model]).
    ``keep_noisy``: also those whose saving is inside the spread (benchmarks apply them).
    ``link``: ``parse_link_curve`` of ``gradring bench allreduce``'s output, for the
    prediction of gradring's collectives on a CPU gloo run of torch's DDP."""
    notes: list[str] = []
    cands: list[Finding] = []
    rank = min(parts, key=lambda r: parts[r]["wait"])  # the rank that waited least
    p = parts[rank]
    steps = [rows[rank][n]["step"] for n in kept if n in rows[rank]]
    spread = spread_ms(steps)
    step = p["step"]
    torch_ddp = model.ddp == "torch"
    if model.facts.get("find_unused") and p["post_forward"] > 0:
        cands.append(Finding(
            "find_unused", "find_unused_parameters=True searches the graph after every forward",
            "construct DDP with find_unused_parameters=False if every parameter gets a "
            "gradient in every step (or static_graph=True if the graph never changes)",
            p["post_forward"] + p.get("unused_map", 0.0),
            f"the search takes {p['post_forward']:.2f} ms/step (events: "
            "torch.distributed.ddp.reducer::search_unused_parameters) and the used-parameter "
            f"map's all-reduce {p.get('unused_map', 0.0):.2f} (its c10d::allreduce_ of "
            "integers, and the wait for it after the buckets' last end)"))
    if p["pre_forward"] > 0:
        cands.append(Finding(
            "forward_sync_buffers", "buffers are broadcast before every forward",
            "construct DDP with forward_sync_buffers=False (broadcast_buffers=False before "
            "torch 2.13) if the buffers do not change, or every rank changes them alike",
            p["pre_forward"],
            f"the broadcast takes {p['pre_forward']:.2f} ms/step of the forward (events: "
            "c10d::broadcast_ inside DistributedDataParallel.forward)"))
    if p["copy"] > 0 and model.facts.get("copies"):
        cands.append(Finding(
            "bucket_view", "reduced gradients are copied into .grad after every backward",
            "construct DDP with gradient_as_bucket_view=True (.grad becomes a view of its "
            "bucket; it cannot be detached in place)", p["copy"],
            f"copying takes {p['copy']:.2f} ms/step after the backward (events: "
            "torch.distributed.ddp.reducer::copy_bucket_to_grad"
            + (", gradring::bucket_write_grads#k)" if not torch_ddp else ")")))
    fit = fit_rank(model, rank, kept, rows[rank]) if model.device == "cpu" else \
        "GPU traces: the bucket findings need the CPU collectives' ends"
    if isinstance(fit, str):
        notes.append(f"the step model could not be fitted to rank {rank}'s trace: {fit}; "
                     "no bucket-size finding")
    else:
        notes.append(f"step model fitted to rank {rank}: curve from {fit.how}; it predicts "
                     f"{fit.current.step_ms:.2f} ms/step for the run's "
                     f"{len(fit.groups)} bucket(s) against {fit.measured_step_ms:.2f} "
                     "measured (medians)")
        rec = recommend_cap(fit, model.ddp)
        if rec is not None:
            best, why = rec
            saving = fit.current.step_ms - best.step_ms
            cands.append(Finding(
                "bucket_cap", f"the bucket layout is far from the step model's pick "
                f"({len(fit.groups)} bucket(s) now)",
                f"construct DDP with bucket_cap_mb={best.cap_mb:g}", saving,
                f"the fitted model predicts {fit.current.step_ms:.2f} ms/step now and "
                f"{best.step_ms:.2f} at {best.cap_mb:g} MiB ({len(best.buckets)} bucket(s)); "
                f"picked as bucket_cap_mb='auto' and gradring tune pick: {why} (events: the "
                "bucket all-reduces, AccumulateGrad)"))
        buckets = model.ranks[rank].steps[0].buckets if model.ranks[rank].steps else ()
        # torch's default cap: a first bucket of at most 1 MiB before buckets of several
        if torch_ddp and len(fit.groups) > 1 and buckets and buckets[0].nbytes and \
                buckets[0].nbytes <= DEFAULT_FIRST_BUCKET_BYTES and statistics.median(
                    b.nbytes or 0 for b in buckets[1:]) >= 2 * DEFAULT_FIRST_BUCKET_BYTES:
            cap = max(b.nbytes or 0 for b in buckets) / MIB
            same = simulate(fit.profile, fit.curve, cap, first_cap_bytes=int(cap * MIB))
            saving = fit.current.step_ms - same.step_ms
            if saving > 0:
                cands.append(Finding(
                    "first_bucket", "torch's 1 MiB first bucket costs a collective",
                    f"pass bucket_cap_mb explicitly (torch then makes the first bucket as "
                    f"large as the others, {cap:.3g} MiB)", saving,
                    f"the first bucket holds {buckets[0].nbytes / MIB:.2f} MiB; the fitted "
                    f"model predicts {same.step_ms:.2f} ms/step with a first bucket of "
                    f"{cap:.3g} MiB (events: the first c10d::allreduce_ of the backward)"))
        if torch_ddp and model.backend == "gloo":
            if link:
                g = _gradring_finding(fit, link)
                if g is not None:
                    cands.append(g)
            else:
                notes.append("what gradring's collectives would save on this host can be "
                             "predicted from its link curve: save `gradring bench allreduce` "
                             "> link.txt and pass --link-curve link.txt")
        own = p["last_bucket"] + p["earlier_buckets"]
        if own > 0:
            half = Profile(*fit.profile[:1], [s // 2 for s in fit.profile.sizes],
                           *fit.profile[2:])
            comp = simulate_groups(half, fit.curve, fit.groups)
            saving = fit.current.step_ms - comp.step_ms
            if saving > 0:
                cands.append(Finding(
                    "comm_hook", "the collectives are exposed: half the bytes would hide more",
                    "register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks."
                    "default_hooks.fp16_compress_hook) if fp16 gradients are accurate enough",
                    saving,
                    f"{own:.2f} ms/step of the buckets' all-reduces are exposed; the fitted "
                    f"model with half the bytes predicts {comp.step_ms:.2f} ms/step (the "
                    "codec's own cost not counted) (events: the bucket all-reduces)"))
    out = []
    for f in cands:
        key = MEASURED.get(f.key)
        against = _row_spread(rows[rank], kept, key) if key else spread
        if _worth(f.saving_ms, step, against) or keep_noisy:
            out.append(f)
        elif f.saving_ms >= MIN_SAVING_MS and f.saving_ms <= against:
            what = f"its {key} row's" if key else "the measured steps'"
            notes.append(f"{f.title}: {f.change} would save {f.saving_ms:.2f} ms/step, inside "
                         f"{what} spread of {against:.2f} ms (interquartile range over the "
                         "steps): the run is too noisy to tell")
    return out, notes
