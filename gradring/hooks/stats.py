"""Byte counting for communication hooks.

Every collective a gradring hook issues is recorded here under the hook's
label, so a benchmark can print "bytes per step" for each hook side by side:

    stats = gradring.hooks.comm_stats()
    stats.reset()
    for _ in range(steps):
        train_step()
    for label, t in stats.snapshot().items():
        print(label, t.payload_bytes / steps, t.wire_bytes / steps)

Two numbers are kept per label:

- ``payload_bytes``: what this rank hands to the collective (the input
  tensor's ``numel * element_size``), independent of the algorithm;
- ``wire_bytes``: what this rank sends under a bandwidth-optimal algorithm:
  ``2 (N-1)/N * payload`` for an all-reduce (ring: reduce-scatter then
  all-gather) and ``(N-1) * payload`` for an all-gather.

The counter is process-wide (one per rank) and thread-safe: hooks record from
future callbacks, which may run on the transport's threads. Hooks that do not
come from gradring (for example torch's own) are not counted.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class HookTraffic(NamedTuple):
    """What one hook label sent since the last reset, on this rank."""

    calls: int
    payload_bytes: int
    wire_bytes: int


class CommStats:
    """Thread-safe per-label counters of collectives issued by gradring's hooks."""

    __slots__ = ("_lock", "_totals")

    def __init__(self) -> None:
        # Callbacks of different buckets may record at the same time.
        self._lock = threading.Lock()
        # label -> [calls, payload bytes, wire bytes]
        self._totals: dict[str, list[int]] = {}

    def record(self, label: str, kind: str, payload_bytes: int, world_size: int) -> None:
        """Count one collective of ``kind`` ("all_reduce" or "all_gather")."""
        if kind == "all_reduce":
            wire = 2 * (world_size - 1) * payload_bytes // max(world_size, 1)
        elif kind == "all_gather":
            wire = (world_size - 1) * payload_bytes
        else:
            raise ValueError(f"unknown collective kind {kind!r}")
        with self._lock:
            row = self._totals.setdefault(label, [0, 0, 0])
            row[0] += 1
            row[1] += payload_bytes
            row[2] += wire

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()

    def snapshot(self) -> dict[str, HookTraffic]:
        """A copy of the counters, by hook label."""
        with self._lock:
            return {k: HookTraffic(*v) for k, v in self._totals.items()}

    def total_payload_bytes(self) -> int:
        with self._lock:
            return sum(v[1] for v in self._totals.values())


_STATS = CommStats()


def comm_stats() -> CommStats:
    """The process-wide counter every gradring hook records into."""
    return _STATS
