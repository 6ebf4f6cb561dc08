"""SIGTERM: release this process's shared memory, say what was pending, then go on dying.

Launchers end the survivors of a failed job with SIGTERM (torchrun does,
right after one rank died) -- often before gradring noticed the dead peer and
printed its error, and the default action kills the process without running
exit hooks, so its named segments would stay in /dev/shm (RAM) until the next
gradring job removes them. The handler, installed when the first shm
transport connects (from the main thread; Python runs handlers there):

1. unlinks the names of every segment this process owns, and those a
   ``kill -9``'d peer of its groups left, and marks its control segments
   closed (peers still waiting stop at their next slice);
   mappings stay until the process ends, so code it interrupted cannot fault;
2. prints the collective error that is pending, if any: a failure not yet
   raised, or the collective in flight and what each peer is doing;
3. defers to what was there before: the previous Python handler is called,
   ``SIG_IGN`` ignores, and the default is restored and the signal sent
   again, so the process still dies of SIGTERM (exit status -15 / 143).
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


def install(transports: Callable[[], Iterable[Any]]) -> None:
    """Install the handler once per process (main thread only; elsewhere nothing).
    ``transports()`` lists the live shm transports."""
    global _installed_in, _previous
    if _installed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    try:
        prev = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda signum, frame: _handle(transports, signum, frame))
    except (ValueError, OSError):  # not the main interpreter / thread
        return
    _previous = signal.SIG_DFL if prev is None else prev
    _installed_in = os.getpid()


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
        print(f"gradring: SIGTERM on pid {os.getpid()} with a collective pending; "
              + " | ".join(notes), file=sys.stderr, flush=True)
    prev = _previous
    if callable(prev):
        prev(signum, frame)
        return
    if prev == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
