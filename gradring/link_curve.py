"""The all-reduce time against message size on a group: what the step model's
``CommCurve`` is measured with.

``bucket_cap_mb="auto"`` (``reducer/autocap.py``), ``gradring explain``
(``tools/explain_record.py``) and ``gradring tune`` all time the same curve: a few
log-spaced sizes up to the model's gradients, each the median of a few
asynchronous all-reduces on the group's own memory (``comm.empty``, as DDP's
buckets are). It lives here, below the reducer and the observers, so that
each of them imports it without reaching into another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring.buckets import MIB
from gradring.step_model import CommCurve, sweep_sizes


def curve_sizes(total_bytes: int, points: int = 6) -> list[int]:
    """A handful of message sizes from 4 KiB up to the whole model (log-spaced)."""
    sizes = sweep_sizes(max(total_bytes, 4096))
    if len(sizes) <= points:
        return sizes
    step = (len(sizes) - 1) / (points - 1)
    return sorted({sizes[round(k * step)] for k in range(points)})


def measure_allreduce(comm: Any, sizes: Sequence[int], *, reps: int | None = None,
                      budget_bytes: int = 64 * MIB,
                      sync: Callable[[], Any] | None = None) -> CommCurve:
    """Median ms of one asynchronous all-reduce (float32) per size, on ``comm``'s own
    memory (``comm.empty``, as DDP's buckets are). Collective: every rank of the group
    calls it at the same point.

    ``reps`` calls per size after one warm-up (which also first-touches the pages);
    None: as many as fit ``budget_bytes``, 3 to 20. ``sync``, when given, runs before
    every timed call (the tuner passes a barrier so ranks start each call together)."""
    buf = comm.empty(max(sizes) // 4 + 1, torch.float32, torch.device("cpu"))
    buf.zero_()
    times = []
    for size in sizes:
        view = buf.narrow(0, 0, max(1, size // 4))
        comm.all_reduce(view).wait()  # warm-up, first touch of the pages
        n = reps if reps is not None else max(3, min(20, budget_bytes // max(size, 1)))
        samples = []
        for _ in range(n):
            if sync is not None:
                sync()
            t = time.perf_counter()
            comm.all_reduce(view).wait()
            samples.append((time.perf_counter() - t) * 1e3)
        times.append(statistics.median(samples))
    return CommCurve(list(sizes), times)
