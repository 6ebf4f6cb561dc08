"""The transports of one process group: made on first use, held, closed together.

Creating the shm transport (and the multi-host ones) is a rendezvous through
the group's store, so the first call that needs one must be made by every
rank: a group's first collective, or its first ``comm.empty``. Which of them
a collective uses is ``select.pick_transport``'s decision.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gradring.comm.board import POLL_S
from gradring.comm.store import group_store
from gradring.comm.transport import Transport
from gradring.comm.transports import hosts as hosts_mod
from gradring.comm.transports.hosts import HostTransports
from gradring.comm.transports.shm import rendezvous
from gradring.comm.transports.shm.transport import ShmTransport
from gradring.comm.transports.torchdist import TorchTransport


class GroupTransports:
    """Shared memory, multi-host and torch point-to-point transports of one group."""

    def __init__(self, group: Any, rank: int, world_size: int, timeout: float,
                 check_missing: Callable[[list[int]], None] | None = None) -> None:
        # The torch process group the transports connect over.
        self.group = group
        self.rank = rank
        self.world_size = world_size
        # Deadline of every collective, in seconds (the waits enforce it).
        self.timeout = timeout
        # Raises while a rendezvous waits if a rank it waits for is known to be gone
        # (``store.wait_keys``).
        self._check_missing = check_missing
        # Transports made so far ("shm" and "hosts" map to None when unavailable).
        self._made: dict[str, Transport | None] = {}
        # Why shm is unavailable (for the error when it is forced).
        self.shm_reason = ""
        # Serialises creation between the engine thread and callers of empty().
        self._lock = threading.Lock()

    def shm(self) -> ShmTransport | None:
        """The shared-memory transport, connecting on first use (collective)."""
        with self._lock:
            if "shm" not in self._made:
                t, why = rendezvous.connect(group_store(self.group), self.rank,
                                            self.world_size, self.timeout,
                                            self._check_missing)
                self._made["shm"], self.shm_reason = t, why
            return self._made["shm"]  # type: ignore[return-value]

    def drop_shm(self, why: str) -> None:
        """Give shared memory up for good (every rank does, in the same collective:
        see ``shm/space.py``); later collectives use the process group."""
        with self._lock:
            t = self._made.get("shm")
            self._made["shm"], self.shm_reason = None, why
        if isinstance(t, ShmTransport):
            t.release_for_fallback()

    def has_shm_answer(self) -> bool:
        """Whether the shm rendezvous already ran (its answer may be "unavailable")."""
        return "shm" in self._made

    def existing_shm(self) -> ShmTransport | None:
        """The shared-memory transport if it is already connected (no rendezvous)."""
        return self._made.get("shm")  # type: ignore[return-value]

    def hosts(self) -> HostTransports | None:
        """Shared memory per host plus point-to-point across hosts, connecting on
        first use (collective); None unless several hosts with equal rank counts > 1."""
        if "hosts" in self._made:  # every collective asks: skip the locks
            return self._made["hosts"]  # type: ignore[return-value]
        flat = self.torch()
        with self._lock:
            if "hosts" not in self._made:
                self._made["hosts"] = hosts_mod.connect(
                    group_store(self.group), self.rank, self.world_size, self.timeout, flat)
            return self._made["hosts"]  # type: ignore[return-value]

    def existing_hosts(self) -> HostTransports | None:
        """The multi-host transports if already connected (no rendezvous)."""
        return self._made.get("hosts")  # type: ignore[return-value]

    def torch(self) -> Transport:
        """Point-to-point over the process group (gloo's send/recv)."""
        with self._lock:
            if "torch" not in self._made:
                # A little past the deadline: the watchdog, which names who arrived,
                # speaks first; gloo's own timeout is the backstop.
                self._made["torch"] = TorchTransport(self.group, self.rank, self.world_size,
                                                     self.timeout + 2 * POLL_S + 0.5)
            return self._made["torch"]  # type: ignore[return-value]

    def abort(self, reason: str) -> None:
        """Make waits blocked in another thread give up (those that can: shm)."""
        for t in list(self._made.values()):
            if t is not None and hasattr(t, "abort"):
                t.abort(reason)

    def close(self) -> None:
        """Close every transport made so far; later calls connect afresh."""
        with self._lock:
            for t in self._made.values():
                if t is not None:
                    t.close()
            self._made.clear()
