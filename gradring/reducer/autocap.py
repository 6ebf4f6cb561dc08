"""``bucket_cap_mb="auto"``: pick the bucket cap at the rebuild, from this job's own backward.

[Note: automatic bucket cap]
``gradring tune`` decides offline ([Note: how the tuner decides] in
``tools/tune.py``). With ``bucket_cap_mb="auto"`` the reducer decides online,
with the same step model ([Note: the step model] in ``step_model.py``) and the
same rule, at the moment torch's DDP rebuilds its buckets (the second
forward), so the choice costs no extra iteration:

1. The first backward already runs with every gradient in one bucket, so its
   gradients arrive undisturbed by communication. While it records the
   arrival order for the rebuild, the reducer also stamps when each gradient
   was ready (ms after the forward returned) and when backward ended.
2. At the rebuild every rank times asynchronous all-reduces of a few sizes, up
   to the whole model, on a ``comm.empty`` buffer of the DDP's own group
   (``measure_allreduce``, 5 calls per size; tens of ms once).
3. Rank 0 alone simulates every cap of ``step_model.DEFAULT_CAPS_MB`` over its
   stamps and curve, picks one by ``pick`` (below), and its plan for the rebuild
   carries it ([Note: the cap's walk] in ``rebuild.py``). ``ddp.bucket_bytes_cap``
   and ``_get_ddp_logging_data()`` report the cap; rank 0's ``reducer.auto_cap``
   keeps the predictions and, in ``why``, the reason for the pick in words
   (``gradring explain`` prints it as a note).

[Note: one rule for picking a cap]
``pick`` is the one rule by which ``bucket_cap_mb="auto"``, ``gradring tune``
and ``gradring explain``'s bucket-cap finding choose a cap from the step
model's predictions: the default (25 MiB, torch's) unless another cap's
predicted step is shorter by more than ``step_model.TIE_TOLERANCE`` (2 %);
then ``step_model.choose``'s pick (the smallest predicted step; among caps
within the tolerance of it, the largest). So a model whose gradients fit one
bucket at 25 MiB keeps 25 MiB: 50 and 100 MiB make the same buckets and
cannot be better. ``gradring tune`` then goes one step further than the
runtime can: it trains DDP at the pick and at the default and keeps the
default unless the pick measured faster beyond the rounds' spread. Where the
two differ on one host, the tuner's report says so and why (the model
predicted a gain that the measurement did not show).

[Note: auto on a host with no free core]
On one host, gradring's all-reduce is CPU work, and when the ranks' backwards
already use every core it can only take a core from a backward: nothing
hides, and every bucket's all-reduce adds its whole time to the step
(``step_model.simulate(overlap=False)``). There the first bucket is not kept
small either (torch's 1 MiB first bucket exists to start communication
early, which buys nothing here), so fewer, larger buckets win. Measured on
the 2-core VM at world 2 (``benchmarks/bucket_caps.py``): with the 1 MiB
first bucket, "auto" picked 25 MiB and the ResNet-shaped model got two
buckets, 4.2 ms of overhead against 3.4-3.7 ms for one bucket; the
12 x Linear(1024) MLP got three buckets, 18.7 ms against 17.9 ms for two.
``has_free_core`` decides which model applies: the CPU cores this process may
run on against the ranks of the group (all on this host when it runs over
shared memory) times torch's intra-op threads per rank.

The profile is one iteration (the first, with its warm-up costs), so the pick
is rougher than ``gradring tune``'s, which times several. Without a rebuild
(``find_unused_parameters=True`` without ``static_graph``) there is nothing
to decide at and the default cap stays, with a warning.

The curve is timed by ``link_curve.measure_allreduce``, as ``gradring tune``
and ``gradring explain`` time it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from gradring.buckets import DEFAULT_FIRST_BUCKET_BYTES, MIB
from gradring.link_curve import curve_sizes, measure_allreduce
from gradring.step_model import (  # noqa: F401 (pick, predict, CapPick, has_free_core: their old home)
    DEFAULT_CAPS_MB,
    CapPick,
    CommCurve,
    Profile,
    has_free_core,
    pick,
    predict,
)


class AutoCap(NamedTuple):
    """What ``bucket_cap_mb="auto"`` decided, and from what (rank 0's view)."""

    cap_bytes: int
    predictions: dict[float, float]  # cap (MiB) -> predicted step ms
    exposed_ms: dict[float, float]   # cap (MiB) -> predicted exposed communication ms
    curve: CommCurve
    backward_ms: float
    why: str = ""                    # the pick's reason ([Note: one rule for picking a cap])
    first_bytes: int = DEFAULT_FIRST_BUCKET_BYTES  # the first bucket's cap after the rebuild


def decide(profile: Profile, curve: CommCurve,
           caps_mb: Sequence[float] = DEFAULT_CAPS_MB, *, free_core: bool = True) -> AutoCap:
    """Simulate every cap and pick one by ``pick``. The per-bucket cost is the smallest
    measured all-reduce, as in ``gradring tune``. Without a free core see [Note: auto
    on a host with no free core]: nothing overlaps, and the first bucket is not kept
    small."""
    per_bucket = curve.times_ms[0]
    preds = [predict(profile, curve, cap, per_bucket_ms=per_bucket, free_core=free_core)
             for cap in caps_mb]
    chosen = pick(preds)
    best = chosen.prediction
    cap_bytes = int(best.cap_mb * MIB)
    first = min(DEFAULT_FIRST_BUCKET_BYTES, cap_bytes) if free_core else cap_bytes
    where = ("" if free_core else "; no free core, so nothing overlaps and the first "
             "bucket is not kept small")
    why = (f"bucket_cap_mb='auto' chose {chosen.why}; step model over the first backward's "
           f"gradient times and all-reduces timed at the rebuild, "
           f"{per_bucket:.2f} ms charged per bucket{where}")
    return AutoCap(cap_bytes, {p.cap_mb: p.step_ms for p in preds},
                   {p.cap_mb: p.exposed_ms for p in preds}, curve, profile.backward_ms, why,
                   first)


def choose_cap(comm: Any, names: list[str], sizes: list[int], keys: list[str],
               ready_ms: list[float], backward_ms: float, step_ms: float) -> AutoCap:
    """Steps 2 and 3 of [Note: automatic bucket cap]: every rank times the link
    (collective over ``comm``'s group); rank 0 decides, other ranks' cap_bytes is 0."""
    curve = measure_allreduce(comm, curve_sizes(sum(sizes)), reps=5)
    if comm.rank != 0:  # rank 0's pick comes with the rebuild's plan (Rebuild.done)
        return AutoCap(0, {}, {}, curve, backward_ms, "bucket_cap_mb='auto' took rank 0's "
                       "pick (its reducer.auto_cap says why)", 0)
    profile = Profile(names, sizes, keys, ready_ms, backward_ms, step_ms)
    devices = [key[1] if isinstance(key, tuple) else key for key in keys]
    return decide(profile, curve, free_core=has_free_core(comm, devices))


class Stamps:
    """Step 1 of [Note: automatic bucket cap]: the recorded backward's timings."""

    def __init__(self, n: int) -> None:
        self.t_forward = 0.0   # the forward started
        self.t_backward = 0.0  # the forward returned (backward is next)
        self.ready = [0.0] * n  # each gradient was ready
        self.t_end = 0.0       # the backward's finalize started

    def mark(self, i: int) -> None:
        self.ready[i] = time.perf_counter()

    def parts(self) -> tuple[list[float], float, float]:
        """(ready ms, backward ms, step ms), all after the forward returned or began."""
        t0 = self.t_backward
        ready = [max(0.0, (t - t0) * 1e3) for t in self.ready]
        backward = max((self.t_end - t0) * 1e3, max(ready, default=0.0))
        return ready, backward, max(backward, (self.t_end - self.t_forward) * 1e3)
