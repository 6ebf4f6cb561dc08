"""gradring's threads: daemons that stop on request, and the waits nothing can wake.

[Note: gradring's threads]
Every thread gradring starts is a :class:`GradringThread`: a daemon whose
``stop()`` asks its loop to end and returns once the thread is dead; its owner
starts a new one at the next use. Each loop blocks only in waits ``stop()``
can cut short (a condition or an event, in slices) or in store calls whose
client has a short timeout, so test suites that police threads (Lightning's
``thread_police_duuu_daaa_duuu_daaa``) find none left behind. One wait cannot
be cut short: a gloo send or receive of the torch transport. It is marked with
:func:`uninterruptible`, so the exit sequence (``comm/leaving.py``) knows the
interpreter must not finalize while a thread is there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator

#: Every GradringThread started in this process and not yet finished.
_LIVE: weakref.WeakSet[GradringThread] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
#: Threads inside a wait nothing can wake (ident -> what it waits for).
_STUCK: dict[int, str] = {}
#: Set once the process has begun to exit: no new gradring thread starts.
exiting = threading.Event()


class GradringThread(threading.Thread):
    """A daemon thread of gradring; see [Note: gradring's threads]."""

    def __init__(self, name: str, target: Callable[[], None],
                 ask_stop: Callable[[], None]) -> None:
        super().__init__(name=name, daemon=True)
        # The loop, and how to ask it to end (sets its flag and wakes it).
        self._body = target
        self._ask_stop = ask_stop

    def start(self) -> None:
        with _LIVE_LOCK:
            _LIVE.add(self)
        super().start()

    def run(self) -> None:
        try:
            self._body()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to end and return once it is dead (or ``timeout`` seconds
        passed, when given)."""
        self._ask_stop()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout)


def live() -> list[GradringThread]:
    """gradring's threads that still run, oldest first."""
    with _LIVE_LOCK:
        found = [t for t in _LIVE if t.is_alive()]
    return sorted(found, key=lambda t: t.ident or 0)


@contextlib.contextmanager
def uninterruptible(what: str) -> Iterator[None]:
    """Mark the calling thread as inside ``what``, a C++ wait nothing can wake."""
    ident = threading.get_ident()
    _STUCK[ident] = what
    try:
        yield
    finally:
        _STUCK.pop(ident, None)


def stuck() -> dict[str, str]:
    """Thread name -> the wait it is in, for every thread inside an uninterruptible wait."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {names.get(i, f"thread {i}"): what for i, what in list(_STUCK.items())}


def _reset_in_child() -> None:
    """A forked child has none of its parent's threads."""
    _STUCK.clear()
    with contextlib.suppress(Exception):
        _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def stuck_idents() -> set[int]:
    """Idents of the threads inside an uninterruptible wait."""
    return set(_STUCK)
