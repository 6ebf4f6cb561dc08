"""Read gradring's own step record into the trace model, for the fitted step model.

gradring's record (``observe/record.py``: the reducer's bucket marks, DDP.forward's and
the optimizer's, and each rank's facts) holds, per iteration, each bucket's ready,
launch, start and done times after the backward's start, and the facts give every
parameter's gradient bytes and bucket. The record traces buckets, not parameters: a
parameter's ready time is spread inside its bucket by cumulative bytes, between the
previous bucket's ready time and its own (as explain's step model always did).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradring.observe.overlap import IterationTimes
from gradring.tools.trace_model import BucketRun, Grad, RankTrace, StepTrace, TraceModel


def _grads(it: IterationTimes, facts: dict[str, Any]) -> tuple[Grad, ...]:
    sizes = facts["sizes"]
    ready = [0.0] * len(sizes)
    prev = 0.0
    for b in sorted(it.buckets, key=lambda x: x.bucket):
        idx = facts["bucket_params"][b.bucket]
        total = sum(sizes[i] for i in idx) or 1
        acc = 0
        for i in idx:
            acc += sizes[i]
            ready[i] = prev + (b.ready - prev) * acc / total
        prev = max(prev, b.ready)
    t0 = it.t0 * 1e6
    return tuple(Grad(s, t0 + r * 1e3) for s, r in zip(sizes, ready))


def step_of(it: IterationTimes, facts: dict[str, Any], step_ms: float) -> StepTrace:
    """One iteration as a ``StepTrace`` (the fields the fitted model reads)."""
    t0 = it.t0 * 1e6
    buckets = tuple(
        BucketRun(k, int(facts["bucket_bytes"][b.bucket]), t0 + b.launch * 1e3,
                  t0 + b.done * 1e3, (), (f"gradring::bucket_all_reduce#{b.bucket}",))
        for k, b in enumerate(sorted(it.buckets, key=lambda x: x.launch)))
    end = t0 + (it.backward_ms + it.tail_ms) * 1e3
    return StepTrace(it.iteration, t0, t0 + step_ms * 1e3, 0.0, t0,
                     t0 + it.backward_ms * 1e3, end, 0.0, 0.0, 0.0, 0.0, buckets,
                     _grads(it, facts))


def record_model(rank: int, iterations: Sequence[IterationTimes], facts: dict[str, Any],
                 step_ms: dict[int, float]) -> TraceModel:
    """One rank's record as a trace model: its ``iterations`` with their steps' lengths
    (``step_ms``: iteration -> ms)."""
    steps = [step_of(it, facts, step_ms[it.iteration]) for it in iterations
             if it.iteration in step_ms]
    return TraceModel("gradring", "gradring", "cpu" if str(facts.get("device", "cpu"))
                      .startswith("cpu") else "cuda", "", int(facts.get("world_size", 1)),
                      {rank: RankTrace(rank, "", steps)})
