"""A model of one DDP step: when each bucket's all-reduce runs, and what it leaves exposed.

Pure arithmetic over two measurements, shared by ``bucket_cap_mb="auto"``
(``reducer/autocap.py``, online) and the command-line tools (``gradring tune`` and
``gradring plan``, offline). Nothing here measures, talks to a process group
or parses arguments, so the runtime imports it without loading any tool.

[Note: the step model]
Inputs: a ``Profile`` of one plain (non-DDP) backward -- per-parameter
gradient sizes, dtype/device keys and ready times, the backward's length and
the whole step's -- and a ``CommCurve``, all-reduce time against message
size. For one candidate cap:

1. Buckets are sealed by ``buckets.assign_buckets`` over the arrival order
   with caps [first bucket, cap], as the reducer's rebuild does.
2. Bucket k launches when all its gradients are ready and bucket k-1 has
   launched; its collective starts when bucket k-1's has finished and lasts
   ``curve.time_ms(bytes)``.
3. Predicted exposed communication = max(0, last finish - end of backward);
   predicted step = step without DDP + exposed + buckets x c, where c, the
   *per-bucket cost*, is what a collective costs the backward even when it
   overlaps (its fixed work runs on the cores the backward uses).
4. Where no core is free for the collectives (``overlap=False``: on one host,
   the shared-memory all-reduce is CPU work on the cores the backward uses),
   nothing hides: every bucket's all-reduce adds its whole time to the
   step, wherever it runs. Predicted exposed = the sum of the buckets'
   times; step 2's timeline is kept only for ``done_ms``.

``choose`` then takes the smallest predicted step; among caps within
``TIE_TOLERANCE`` of it, the largest (fewer collectives: their fixed costs are
the least well measured part of the model). [Note: how the tuner decides] in
``tools/tune.py`` says how the tuner measures the inputs and checks the pick.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from gradring.buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, assign_buckets

#: The candidate caps (MiB) that ``gradring tune`` and ``bucket_cap_mb="auto"`` simulate.
DEFAULT_CAPS_MB = (0.25, 0.5, 1, 2, 4, 8, 16, 25, 50, 100)
#: Caps whose predicted step is within this fraction of the best tie (see the Note).
TIE_TOLERANCE = 0.02


class Profile(NamedTuple):
    """One backward of the plain model, as measured."""

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
             first_cap_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
             overlap: bool = True) -> Prediction:
    """Predict exposed communication and step time for one cap ([Note: the step model];
    ``overlap=False``: no core is free for the collectives, its point 4)."""
    order = sorted(range(len(profile.sizes)), key=lambda i: (profile.ready_ms[i], i))
    groups = assign_buckets(profile.sizes, [first_cap_bytes, int(cap_mb * MIB)],
                            keys=profile.keys, order=order)
    return simulate_groups(profile, curve, groups, cap_mb, per_bucket_ms=per_bucket_ms,
                           overlap=overlap)


def simulate_groups(profile: Profile, curve: CommCurve, groups: Sequence[Sequence[int]],
                    cap_mb: float = 0.0, *, per_bucket_ms: float = 0.0,
                    overlap: bool = True) -> Prediction:
    """``simulate`` for a given bucket layout (parameter indices per bucket, in launch
    order): steps 2-4 of [Note: the step model]. ``gradring explain`` predicts the layout a
    run measured with it, to fit the model to that run."""
    launched = done = float("-inf")
    finishes = []
    busy = 0.0
    for group in groups:
        ready = max(profile.ready_ms[i] for i in group)
        launched = max(launched, ready)
        start = max(launched, done)
        took = curve.time_ms(sum(profile.sizes[i] for i in group))
        done = start + took
        busy += took
        finishes.append(done)
    if not overlap:
        exposed = busy
    else:
        exposed = max(0.0, done - profile.backward_ms) if groups else 0.0
    step = profile.step_ms + exposed + per_bucket_ms * len(groups)
    return Prediction(cap_mb, [list(g) for g in groups], exposed, step, finishes)


def choose(predictions: Sequence[Prediction], tolerance: float = TIE_TOLERANCE) -> Prediction:
    """The smallest predicted step; among those within ``tolerance`` of it, the largest cap."""
    best = min(p.step_ms for p in predictions)
    near = [p for p in predictions if p.step_ms <= best * (1 + tolerance)]
    return max(near, key=lambda p: p.cap_mb)


def sweep_sizes(total_bytes: int, smallest: int = 4096) -> list[int]:
    """Message sizes for the all-reduce curve: powers of two up to the whole model."""
    sizes, s = [], smallest
    while s * 1.25 < total_bytes:  # no power of two right next to the total
        sizes.append(s)
        s *= 2
    return sizes + [max(total_bytes, smallest)]


# [Note: one rule for picking a cap] (reducer/autocap.py) and auto's model of the host.
class CapPick(NamedTuple):
    """What ``pick`` chose among the predictions, and why, in words."""

    prediction: Prediction
    default: Prediction | None  # the default cap's prediction, if it was simulated
    why: str


def pick(predictions: Sequence[Prediction],
         default_mb: float = DEFAULT_BUCKET_CAP_MB) -> CapPick:
    """[Note: one rule for picking a cap]: the default cap unless another's predicted
    step is shorter by more than ``TIE_TOLERANCE``; then ``step_model.choose``'s pick."""
    if not predictions:
        raise ValueError("pick needs at least one predicted cap")
    best = choose(predictions)
    default = next((p for p in predictions if p.cap_mb == default_mb), None)
    if default is None:
        return CapPick(best, None, f"{best.cap_mb:g} MiB: the shortest predicted step, "
                       f"{best.step_ms:.2f} ms ({len(best.buckets)} bucket(s))")
    fastest = min(p.step_ms for p in predictions)
    if default.buckets == best.buckets or default.step_ms <= fastest * (1 + TIE_TOLERANCE):
        if best.cap_mb == default_mb:
            other = ""
        elif default.buckets == best.buckets:
            other = f"; {best.cap_mb:g} MiB makes the same buckets"
        else:
            other = f"; {best.cap_mb:g} MiB predicts {best.step_ms:.2f} ms"
        return CapPick(default, default,
                       f"the default {default_mb:g} MiB: no cap's predicted step beats its "
                       f"{default.step_ms:.2f} ms by more than {TIE_TOLERANCE:.0%}{other}")
    return CapPick(best, default,
                   f"{best.cap_mb:g} MiB: predicted step {best.step_ms:.2f} ms "
                   f"({len(best.buckets)} bucket(s)) against {default.step_ms:.2f} ms at the "
                   f"default {default_mb:g} MiB ({len(default.buckets)} bucket(s))")


def predict(profile: Profile, curve: CommCurve, cap_mb: float, *, per_bucket_ms: float,
            free_core: bool) -> Prediction:
    """``simulate`` with the model of the host that auto, ``gradring tune`` and
    ``gradring explain`` share: with a free core the buckets overlap the backward
    behind torch's 1 MiB first bucket; without one ([Note: auto on a host with no
    free core]) nothing overlaps and the first bucket is as large as the others."""
    return simulate(profile, curve, cap_mb, per_bucket_ms=per_bucket_ms,
                    first_cap_bytes=DEFAULT_FIRST_BUCKET_BYTES if free_core
                    else int(cap_mb * MIB), overlap=free_core)


def has_free_core(comm: Any, devices: Sequence[Any]) -> bool:
    """Whether a core is left for the collectives beside the ranks' backwards (see
    [Note: auto on a host with no free core]). True unless every gradient is on the
    CPU (``devices``: the gradients' devices, or their names) and the group runs over
    shared memory (all its ranks on this host) with no more cores than ranks times
    intra-op threads."""
    if any(str(d).split(":")[0] != "cpu" for d in devices):
        return True
    if not comm.on_shared_memory():
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    import torch

    return cores > comm.world_size * torch.get_num_threads()
