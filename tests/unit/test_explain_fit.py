"""explain's fitted step model on synthetic profiled steps: the oracle is the timeline the
steps were made from (serial collectives of a + b x bytes after their last gradient)."""

from __future__ import annotations

import pytest

from gradring.buckets import MIB, assign_buckets
from gradring.tools import analysis, findings
from gradring.tools.trace_model import BucketRun, Grad, RankTrace, StepTrace, TraceModel

SIZES = [MIB // 4, MIB] * 8               # sixteen gradients of 0.25 and 1 MiB
READY_MS = [1.0 + 1.5 * i for i in range(16)]   # every 1.5 ms over a 24 ms backward
BACKWARD_MS = 24.0
A_MS, B_MS_PER_MIB = 0.4, 0.9             # the link: 0.4 ms + 0.9 ms/MiB


def _layout(cap_mb: float, first: int) -> list[list[int]]:
    order = sorted(range(len(SIZES)), key=lambda i: READY_MS[i])
    return assign_buckets(SIZES, [first, int(cap_mb * MIB)], keys=["g"] * len(SIZES),
                          order=order)


def _model(groups: list[list[int]], steps: int = 6, jitter: float = 0.0,
           other_ms: float = 10.0) -> TraceModel:
    out = []
    for n in range(steps):
        t0 = n * 1e6                       # us
        b0 = t0 + 5e3 + (jitter * 1e3 * (n % 3))
        grads = tuple(Grad(s, b0 + r * 1e3) for s, r in zip(SIZES, READY_MS))
        b1 = b0 + BACKWARD_MS * 1e3
        buckets, launched, done = [], b0, float("-inf")
        for k, g in enumerate(groups):
            launched = max(launched, b0 + max(READY_MS[i] for i in g) * 1e3)
            nbytes = sum(SIZES[i] for i in g)
            start = max(launched, done)
            done = start + (A_MS + B_MS_PER_MIB * nbytes / MIB) * 1e3
            buckets.append((k, nbytes, launched, done))
        tail = max(b1, done)
        runs, prev = [], float("-inf")
        for k, nbytes, launched, d in buckets:
            last = k == len(buckets) - 1
            hi = float("inf") if last else max(d, prev)
            span = (max(b1, prev), min(tail, hi))
            runs.append(BucketRun(k, nbytes, launched, d,
                                  (span,) if span[1] > span[0] else (), ("c10d::allreduce_",)))
            prev = max(prev, d)
        end = tail + other_ms * 1e3
        out.append(StepTrace(n, t0, end, 5.0, b0, b1, tail, 0.0, 0.0, 0.0, 0.0,
                             tuple(runs), grads))
    return TraceModel("torch.profiler", "torch", "cpu", "gloo", 1,
                      {0: RankTrace(0, "h", out)})


def _fit(model: TraceModel) -> findings.Fit:
    rows, kept, _ = analysis.rank_rows(model)
    fit = findings.fit_rank(model, 0, kept, rows[0])
    assert not isinstance(fit, str), fit
    return fit


def test_the_fitted_model_reproduces_the_measured_step() -> None:
    model = _model(_layout(1.0, MIB // 4))
    rows, kept, _ = analysis.rank_rows(model)
    fit = _fit(model)
    measured = [rows[0][n]["step"] for n in kept]
    assert fit.current.step_ms == pytest.approx(measured[0], rel=1e-3)
    assert fit.current.exposed_ms == pytest.approx(rows[0][0]["exposed_comm"], abs=0.06)
    # the curve came from the steps' own collectives: the link they were made with
    assert fit.curve.time_ms(MIB) == pytest.approx(A_MS + B_MS_PER_MIB, rel=0.02)
    assert len(fit.groups) == len(_layout(1.0, MIB // 4))


def test_at_the_recommended_cap_explain_recommends_no_other() -> None:
    # torch's default: a 1 MiB first bucket, then everything in one 19 MiB bucket that
    # starts only when the backward ends
    model = _model(_layout(25, MIB))
    fit = _fit(model)
    rec = findings.recommend_cap(fit, "torch")
    assert rec is not None
    best, _ = rec
    assert best.cap_mb != 25 and best.step_ms < fit.current.step_ms
    # run "again" at the recommended cap: the steps the model predicts there
    first = MIB if best.cap_mb == 25 else int(best.cap_mb * MIB)
    again = _model(_layout(best.cap_mb, min(first, int(best.cap_mb * MIB))))
    assert findings.recommend_cap(_fit(again), "torch") is None


def test_a_saving_inside_the_steps_spread_is_too_noisy_to_tell() -> None:
    model = _model(_layout(25, MIB), other_ms=10.0)
    # the same steps, but their "other" time scattered by 0-60 ms: no finding, a note
    noisy = _model(_layout(25, MIB))
    for n, st in enumerate(noisy.ranks[0].steps):
        noisy.ranks[0].steps[n] = st._replace(end_us=st.end_us + (n % 3) * 30e3)
    quiet = analysis.explain_model(model)
    loud = analysis.explain_model(noisy)
    assert "bucket_cap" in quiet.keys(), quiet.text
    assert "bucket_cap" not in loud.keys()
    assert any("too noisy to tell" in n for n in loud.notes), loud.notes


BENCH = """#      size  variant                        time(us)  algbw(GB/s)  busbw(GB/s)  vs gloo
     64 KiB  gradring-shm (comm.empty)         200.0        0.087        0.087    1.83x
     64 KiB  gloo native                       400.0        0.047        0.047    1.00x
      4 MiB  gradring-shm (comm.empty)        1000.0        3.071        3.071    3.97x
      4 MiB  gradring ring (gloo p2p)         9618.3        0.436        0.436    0.56x
      4 MiB  gloo native                      2000.0        0.774        0.774    1.00x
"""


def test_gradrings_collectives_are_predicted_from_the_link_curve() -> None:
    link = findings.parse_link_curve(BENCH)
    assert link == {64 * 1024: (200.0, 400.0), 4 * MIB: (1000.0, 2000.0)}
    model = _model(_layout(25, MIB))
    rows, kept, _ = analysis.rank_rows(model)
    fit = _fit(model)
    parts = {0: {k: sum(rows[0][n][k] for n in kept) / len(kept) for k in rows[0][kept[0]]}}
    found, _ = findings.profile_findings(model, parts, rows, kept, keep_noisy=True, link=link)
    g = next(f for f in found if f.key == "gradring_collectives")
    # gloo twice as slow as gradring at every size: the model with half the curve
    half = findings.simulate_groups(fit.profile, findings.curve_of(
        0.5 * fit.curve.times_ms[0], 0.0, 1)._replace(
        sizes=fit.curve.sizes, times_ms=[0.5 * t for t in fit.curve.times_ms]), fit.groups)
    assert g.saving_ms == pytest.approx(fit.current.step_ms - half.step_ms, rel=1e-6)
    assert g.saving_ms > 0 and "prediction" in g.evidence
