"""SIGTERM: release this process's shared memory, say what was pending, then go on dying.

Launchers end a failed job's survivors with SIGTERM, whose default action runs
no exit hook, so named segments would stay in /dev/shm. The handler unlinks
this process's segment names and those a ``kill -9``'d peer left, marks its
control segments closed (mappings stay, so interrupted code cannot fault),
prints the pending collective error, then defers to the previous handler (the
default is restored and the signal sent again: the process still dies of
SIGTERM). docs/reliability.md ("Leaks") has the user's view.

[Note: installing the SIGTERM handler from the main thread]
Only the main thread may call ``signal.signal``, and the first shm connect runs
in whichever thread issues the group's first collective. So the handler is
installed at the first of these that runs on the main thread: the creation of
a group's context (``comm.context``), the first connect, or the next time the
main thread enters gradring (:func:`install_deferred`, one global read when
nothing is pending). A process whose main thread never enters gradring gets
no handler; its segments are then removed by its peers or by the next job's
sweep (``segments.remove_stale_segments``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

_installed_in: int | None = None  # pid that installed the handler
_previous: Any = signal.SIG_DFL
#: What to install once the main thread comes by (set by an install off the main
#: thread; see [Note: installing the SIGTERM handler from the main thread]).
deferred: Callable[[], Iterable[Any]] | None = None


def installed() -> bool:
    """Whether this process has the handler."""
    return _installed_in == os.getpid()


def install(transports: Callable[[], Iterable[Any]]) -> None:
    """Install the handler once per process; off the main thread, remember to do it at
    the main thread's next :func:`install_deferred`. ``transports()`` lists the live
    shm transports."""
    global _installed_in, _previous, deferred
    if _installed_in == os.getpid():
        return
    if threading.current_thread() is not threading.main_thread():
        deferred = transports
        return
    deferred = None
    try:
        prev = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: _handle(transports, signum, frame))
    except (ValueError, OSError):  # not the main interpreter / thread
        return
    _previous = signal.SIG_DFL if prev is None else prev
    _installed_in = os.getpid()


def install_deferred() -> None:
    """On the main thread: install the handler an earlier :func:`install` from another
    thread asked for (cheap when there is none)."""
    wanted = deferred
    if wanted is not None and threading.current_thread() is threading.main_thread():
        install(wanted)


def _handle(transports: Callable[[], Iterable[Any]], signum: int, frame: Any) -> None:
    notes = []
    # A forked child (a DataLoader worker) inherits the handler but owns nothing here.
    mine = list(transports()) if os.getpid() == _installed_in else []
    for t in mine:
        try:
            note = t.pending_error()
            t.release_names()
        except Exception as exc:  # noqa: BLE001 - never fail inside a signal handler
            note = f"(could not release shared memory: {exc})"
        if note:
            notes.append(note)
    if notes:
        print(f"gradring: SIGTERM on pid {os.getpid()}: "
              + " | ".join(notes), file=sys.stderr, flush=True)
    prev = _previous
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _reset_in_child() -> None:
    """A forked child (a DataLoader worker) owns no transport: no deferred install."""
    global deferred
    deferred = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
