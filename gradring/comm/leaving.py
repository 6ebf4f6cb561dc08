"""How a gradring process exits: threads stopped and joined, groups released, before
the interpreter finalizes.

[Note: how a gradring process exits]
CPython 3.11 ends a daemon thread that takes the GIL while the interpreter
finalizes with ``pthread_exit``. Inside a C++ call made through pybind11 (a
gloo wait, a store call, gloo's own worker freeing a tensor) that unwinds a
``noexcept`` destructor: ``terminate called without an active exception``,
SIGABRT, a core dump -- after the job may have printed a clear error. So
nothing of gradring may be inside such a call when finalization begins:

1. Every process that imported gradring runs :func:`begin` from
   ``threading._register_atexit``: at the end of the main module (normal
   return, an exception leaving it, ``sys.exit``), before daemon threads are
   abandoned and before ``atexit``; in a ``multiprocessing`` child (fork or
   spawn) from its ``_bootstrap``, before ``os._exit`` or the spawned child's
   ``sys.exit``. It runs once per process.
2. Work in flight is abandoned: queued collectives fail, shared-memory waits
   give up (their peers see this rank's closed state, then its pid gone:
   "rank N exited"), the watchdog fails what it watches, every group's
   context posts "left" on its board and closes (``context.py``).
3. Every gradring thread is stopped and joined, in order: the engines, the
   watchdog, the heartbeat, orphan-watch, and last the store helpers (the
   board posts above go through them). Each waits in short slices or in
   waits its ``stop()`` wakes (see [Note: gradring's threads] in
   ``threads.py``).
4. The default process group, if the program did not destroy it, is
   destroyed (``torch.distributed.destroy_process_group()``), so gloo's own
   threads are joined now, not while the interpreter finalizes (gloo frees a
   finished collective's tensors there and takes the GIL: torch alone dies of
   SIGABRT that way). ``GRADRING_EXIT_DESTROY=0`` leaves it to the program.
5. One wait cannot be woken: a gloo send or receive of the torch transport
   (or a collective gloo runs itself, ``GRADRING_ALGO=native``) still in
   flight. While one is, the interpreter must not finalize, and waiting for
   it may take the whole deadline. So the process ends at the last step of
   ``atexit`` (:func:`_last_word`, registered when gradring is imported)
   with ``os._exit`` and the exit status the program chose (``sys.exit``'s
   code, 1 after an uncaught exception, a ``multiprocessing`` child's own
   code, else 0), after flushing its output and logging. Its peers get
   gloo's closed connection and gradring's "rank N exited".

``torch.distributed.destroy_process_group()`` (patched when gradring is
imported) first releases gradring's state of the groups it destroys --
engine threads joined, store helpers stopped -- so nothing of gradring
keeps a destroyed group, and with it gloo's threads, alive.

A SIGTERM (torchrun stopping the survivors) ends the process by the signal
after its handler (``transports/shm/sigterm.py``): no finalization runs.

``GRADRING_DEBUG=exit`` prints one line on stderr for each gradring thread,
group and pending collective still alive when the exit begins, and one for
each thread still in a wait nothing can wake when it ends.
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
