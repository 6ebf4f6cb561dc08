"""How a gradring process exits: threads stopped and joined, groups released, before
the interpreter finalizes.

[Note: how a gradring process exits]
CPython 3.11 ends a daemon thread that takes the GIL while the interpreter
finalizes with ``pthread_exit``; inside a C++ call made through pybind11 (a
gloo wait, a store call, gloo's worker freeing a tensor) that unwinds a
``noexcept`` destructor: SIGABRT and a core dump, after the job may have
printed a clear error. So nothing of gradring may be inside such a call when
finalization begins:

1. :func:`begin` runs from ``threading._register_atexit`` (before daemon
   threads are abandoned and before ``atexit``; in a ``multiprocessing``
   child from its ``_bootstrap``), once per process;
2. work in flight is abandoned and every group's context posts "left" and
   closes (``context.py``);
3. every gradring thread is stopped and joined, the store helpers last (the
   posts above go through them; see [Note: gradring's threads]);
4. the default process group, unless the program destroyed it, is destroyed
   (gloo's threads joined now; ``GRADRING_EXIT_DESTROY=0`` leaves it);
5. a gloo send or receive still in flight cannot be woken, and finalizing
   beside it is the crash: the process ends at the last ``atexit`` step
   (:func:`_last_word`) with ``os._exit`` and the status the program chose,
   after flushing its output and logging.

docs/reliability.md ("How a gradring process exits") has the user's view:
the patched ``destroy_process_group``, SIGTERM, ``GRADRING_DEBUG=exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from gradring import config
from gradring.comm import threads

#: The code the program passed to ``sys.exit`` last (None: it never called it).
_exit_code: int | None = None
#: The pid whose exit sequence ran (it runs once per process).
_begun_in = 0
#: Set by the exit sequence when a wait nothing can wake was still in flight.
_must_skip_finalization = False
#: A multiprocessing child's own exit status, read where its _bootstrap ends.
_child_code: int | None = None


def _code_of(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


_original_exit: Callable[..., Any] = sys.exit


def _recording_exit(code: Any = None) -> None:
    """``sys.exit`` that remembers its code (see step 5 of the Note)."""
    global _exit_code
    if threading.current_thread() is threading.main_thread():  # elsewhere it ends a thread
        _exit_code = _code_of(code)
    _original_exit(code)


def _bootstrap_code() -> int | None:
    """A multiprocessing child's exit status, from the ``_bootstrap`` that calls us."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_bootstrap" and "exitcode" in frame.f_locals:
            return _code_of(frame.f_locals["exitcode"])
        frame = frame.f_back  # type: ignore[assignment]
    return None


def exit_status() -> int:
    """The status the program chose, as far as gradring can tell (step 5 of the Note)."""
    if _child_code is not None:
        return _child_code
    if _exit_code is not None:
        return _exit_code
    last = getattr(sys, "last_value", None)
    if last is not None and not isinstance(last, SystemExit):
        return 1
    return 0


def debugging() -> bool:
    """Whether ``GRADRING_DEBUG=exit`` is set."""
    try:
        return config.current().debug == "exit"
    except config.ConfigError:
        return False


def say(line: str) -> None:
    """One diagnostic line on stderr (``GRADRING_DEBUG=exit``)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"gradring exit (pid {os.getpid()}): {line}\n")
        sys.stderr.flush()


def begin(release: Callable[[], list[str]], destroy_default: Callable[[], None]) -> None:
    """The exit sequence (steps 1-4 of the Note). ``release()`` abandons and closes every
    group's state and returns the collectives gloo was still running for gradring;
    ``destroy_default()`` destroys the default group."""
    global _begun_in, _must_skip_finalization, _child_code
    code = _bootstrap_code()  # set only where a child's _bootstrap has its status
    if code is not None:
        _child_code = code
    if _begun_in == os.getpid():
        return
    _begun_in = os.getpid()
    started = time.monotonic()
    threads.exiting.set()
    native = release()
    for t in threads.live():
        # What release() left: the store helpers its last posts went through (engines,
        # watchdog, heartbeat and orphan-watch are stopped by then); a thread inside a
        # gloo wait cannot be joined.
        if t.ident in threads.stuck_idents():
            continue
        t.stop(timeout=5.0)
    stuck = threads.stuck()
    _must_skip_finalization = bool(stuck or native)
    if not _must_skip_finalization:
        wanted = True
        with contextlib.suppress(config.ConfigError):
            wanted = config.current().exit_destroy
        if wanted:
            with contextlib.suppress(Exception):
                destroy_default()
    if debugging():
        for name, what in stuck.items():
            say(f"thread {name} is still in {what}: the process ends without finalizing")
        for what in native:
            say(f"{what} was still in flight in gloo: the process ends without finalizing")
        say(f"threads stopped and groups released in {time.monotonic() - started:.2f}s")


def _last_word() -> None:
    """The last ``atexit`` handler: end the process here when a wait nothing can wake is
    still in flight (step 5 of the Note)."""
    if _begun_in != os.getpid() or not (_must_skip_finalization or threads.stuck()):
        return
    code = exit_status()
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(code)


def install(sequence: Callable[[], None]) -> None:
    """Run ``sequence`` (which calls :func:`begin`) when the process exits; called once,
    when gradring is imported."""
    sys.exit = _recording_exit
    try:
        threading._register_atexit(sequence)  # type: ignore[attr-defined]
    except RuntimeError:  # imported while the process already exits: atexit still runs
        atexit.register(sequence)


# Registered when this module is imported, ahead of every other atexit handler of
# gradring (``engine.py`` imports it first): atexit runs handlers last-in first-out.
atexit.register(_last_word)


def _reset_in_child() -> None:
    global _begun_in, _must_skip_finalization, _child_code
    _begun_in, _must_skip_finalization, _child_code = 0, False, None
    threads.exiting.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
