"""Per-iteration events of the reducer, kept in a fixed-size ring buffer.

The reducer marks a handful of events per bucket per iteration (ready,
launch, comm done, written) plus the backward's start and end. Each mark is
one ``perf_counter`` call and a deque append, so tracing stays on always.
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple


class Event(NamedTuple):
    """One timestamped reducer event."""

    iteration: int
    kind: str        # backward_start | ready | launch | comm_done | written | backward_end
    bucket: int      # -1 for iteration-wide events
    t: float         # time.perf_counter() seconds


class Trace:
    """A ring buffer of the most recent reducer events."""

    def __init__(self, capacity: int = 4096) -> None:
        # Fixed capacity: memory stays flat however long training runs.
        self.events: collections.deque[Event] = collections.deque(maxlen=capacity)
        # Iteration number stamped on new events (the reducer advances it).
        self.iteration = 0
        # Internal switch for measuring what tracing costs (``gradring bench ddp``
        # compares both); overlap statistics and timelines need it on.
        self.enabled = True

    def mark(self, kind: str, bucket: int = -1, iteration: int | None = None) -> None:
        if not self.enabled:
            return
        it = self.iteration if iteration is None else iteration
        self.events.append(Event(it, kind, bucket, time.perf_counter()))

    def iteration_events(self, iteration: int) -> list[Event]:
        return [e for e in self.events if e.iteration == iteration]

    def first(self, iteration: int, kind: str, bucket: int = -1) -> float | None:
        for e in self.events:
            if e.iteration == iteration and e.kind == kind and e.bucket == bucket:
                return e.t
        return None
