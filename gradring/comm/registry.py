"""The registry of the process groups gradring has state for, below everything that
keeps such state: ``context.py`` keeps each group's context here, and
``store.py`` (lower down) asks whether a group failed; it imports nothing of
gradring, so neither needs the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container
from typing import Any, Protocol


class Registered(Protocol):
    """What the registry asks of a group's state."""

    def has_failed(self) -> bool:
        """Whether a collective of the group failed in this process."""

    def close(self, timeout: float = 10.0, abandon: str | None = None) -> None:
        """Release the group's threads and memory (``abandon``: the process exits)."""


class GroupRegistry:
    """Process group -> its gradring state, made once per group, thread-safe."""

    def __init__(self) -> None:
        # The state of every group seen so far (keys: torch process groups).
        self._entries: dict[Any, Registered] = {}
        # Guards making, removing and listing entries (lookups read without it).
        self._lock = threading.Lock()
        # ``get(group)``: the state of ``group`` or None, never making one. The dict's
        # own method: every collective looks its group up, without a Python frame.
        self.get: Callable[[Any], Registered | None] = self._entries.get

    def get_or_make(self, group: Any, make: Callable[[Any], Registered]) -> Registered:
        """The state of ``group``, made with ``make(group)`` by the first caller."""
        found = self._entries.get(group)
        if found is not None:
            return found
        with self._lock:
            found = self._entries.get(group)
            if found is None:
                found = self._entries[group] = make(group)
        return found

    def pop(self, group: Any) -> Registered | None:
        """Remove and return the state of ``group`` (None if there was none)."""
        with self._lock:
            return self._entries.pop(group, None)

    def values(self) -> list[Registered]:
        """Every group's state, without removing any."""
        with self._lock:
            return list(self._entries.values())

    def pop_all(self) -> list[Registered]:
        """Remove and return every group's state."""
        with self._lock:
            found = list(self._entries.values())
            self._entries.clear()
        return found

    def pop_missing(self, live: Container[Any]) -> list[Registered]:
        """Remove and return the state of every group not in ``live``."""
        with self._lock:
            dead = [g for g in self._entries if g not in live]
            return [self._entries.pop(g) for g in dead]

    def forget(self) -> None:
        """Drop every entry without closing it (a forked child: see ``context.py``)."""
        self._entries.clear()

    def failed(self, group: Any) -> bool:
        """Whether a gradring collective of ``group`` has failed in this process."""
        found = self._entries.get(group)
        return found is not None and found.has_failed()


#: The one registry of this process.
GROUPS = GroupRegistry()
