"""Workers whose launcher died: stop them, and leave nothing of the job in /dev/shm.

[Note: orphaned workers]
torchrun's agent ends the other workers with SIGTERM when one fails; when the
agent itself dies (``kill -9``, the OOM killer) nobody does, and the workers go
on, reparented, holding their segments in /dev/shm. So a worker started by
torchrun (``TORCHELASTIC_RUN_ID`` set) watches ``os.getppid()`` every
``POLL_S`` from a daemon thread started with its first group context. Once the
parent changed it prints one line, unlinks its own and its dead peers' segment
names (as the SIGTERM handler does) and sends itself SIGTERM, so it dies as it
would have under the agent (``sigterm.py``). Outside torchrun nothing is
watched: a process whose shell exits is not an orphan to stop.
``prctl(PR_SET_PDEATHSIG)`` is not used: the kernel sends it when the *thread*
that forked the worker ends, which would kill healthy workers of a launcher
that forks from a short-lived thread, and it unlinks nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from gradring.comm import threads

#: How often the watcher compares the parent pid (seconds).
POLL_S = 0.2

_watching: int | None = None  # pid whose watcher thread runs
_stop = threading.Event()  # set by the watcher's stop()
_thread: Any = None  # the watcher (a GradringThread)


def launched_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic's agent) started this process."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def watch(transports: Callable[[], Iterable[Any]], rank: int = -1) -> None:
    """Start this process's watcher once (only under torchrun). ``transports()`` lists
    the live shm transports; ``rank`` is for the message."""
    global _watching
    if _watching == os.getpid() or not launched_by_torchrun():
        return
    parent = os.getppid()
    if parent <= 1:
        return  # already orphaned before anything was watched: nothing to compare
    if threads.exiting.is_set():
        return
    global _thread
    _watching = os.getpid()
    _stop.clear()
    _thread = threads.GradringThread("gradring-orphan-watch",
                                     lambda: _loop(parent, transports, rank), _stop.set)
    _thread.start()


def stop() -> None:
    """Stop the watcher; return once it is dead (the next group context starts it again)."""
    thread = _thread
    if thread is not None and _watching == os.getpid():
        thread.stop()


def _loop(parent: int, transports: Callable[[], Iterable[Any]], rank: int) -> None:
    global _watching
    while os.getppid() == parent:
        if _stop.wait(POLL_S):
            _watching = None  # the next watch() starts a new watcher
            return
    _orphaned(parent, transports, rank)


def _orphaned(parent: int, transports: Callable[[], Iterable[Any]], rank: int) -> None:
    who = f"pid {os.getpid()}" + (f" (rank {rank})" if rank >= 0 else "")
    print(f"gradring: {who}: the torchrun agent that started this worker (pid {parent}) "
          f"is gone; stopping this worker with SIGTERM and removing its shared memory, so "
          f"that nothing of the job outlives it", file=sys.stderr, flush=True)
    for t in list(transports()):
        try:
            t.release_names()
        except Exception:  # noqa: BLE001 - the signal below must still go out
            pass
    os.kill(os.getpid(), signal.SIGTERM)


def _reset_in_child() -> None:
    """A forked child has no watcher thread (and another parent)."""
    global _watching
    _watching = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
