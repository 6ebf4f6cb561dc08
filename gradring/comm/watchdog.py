"""The watchdog thread: deadlines and fail-fast for collectives gradring cannot interrupt.

[Note: how a stuck collective ends]
Every collective has a deadline (the process group's timeout, or
``GRADRING_TIMEOUT``), enforced where the bytes move: on shm the waiting
thread checks it, the peers' pids and their state words every 50 ms slice;
the torch transport's ``wait_all`` waits in slices and asks the group's
:class:`PeerBoard`; a native (gloo) collective cannot be interrupted, so the
:class:`Watchdog` thread fails the future gradring returned at *gradring's*
deadline, or as soon as the board shows a failed or departed peer. So a dead
peer ends a collective within a slice or two, a peer that left as soon as it
exits, and a stuck one at the deadline; the error names the collective and
which ranks arrived (docs/reliability.md, "Timeouts", shows one).

[Note: the watchdog thread never dies]
The thread is the only deadline of native and torch-transport collectives,
so nothing it meets ends it: a check that raises (a forged store value,
``StoreValueError``, [Note: the store is not trusted]; a store answering
nonsense; a bug) becomes the verdict on the collectives it was checking, which
fail as a timeout fails them, and the thread watches on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from gradring.comm import desync, peers, threads
from gradring.comm.board import (
    ABANDONED,
    BOARD_AFTER_S,
    POLL_S,
    PeerBoard,
    StoreValueError,
    arrivals,
    describe_status,
)
from gradring.comm.recorder import Entry

#: Seconds an idle watchdog thread lingers before exiting.
_LINGER_S = 5.0


class WatchdogError(RuntimeError):
    """The watchdog's verdict: the deadline passed, or a peer failed or left."""

    def __init__(self, message: str, peer_error: str = "") -> None:
        super().__init__(message)
        # Type name of the failed peer's own error ("DesyncError"), if that was the cause.
        self.peer_error = peer_error


class _Watched:
    __slots__ = ("entry", "future", "value", "deadline", "timeout", "board", "rank",
                 "world_size", "on_fail", "owner", "settled")

    def __init__(self, entry: Entry, future: torch.futures.Future, value: list,
                 timeout: float, board: PeerBoard | None, rank: int, world_size: int,
                 on_fail: Callable[[BaseException], BaseException], owner: Any) -> None:
        self.entry = entry  # what the collective is
        self.future = future  # gradring's future, completed by gloo's callback or here
        self.value = value  # what it resolves to
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.board = board  # fail-fast markers of the group
        self.rank = rank
        self.world_size = world_size
        self.on_fail = on_fail  # turns the cause into the error the caller sees
        self.owner = owner  # the group context, to cancel its work at shutdown
        self.settled = False  # guarded by Watchdog._lock


class Watchdog:
    """Fails native collectives that outlive gradring's deadline or lose a peer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._watched: list[_Watched] = []
        self._thread: threads.GradringThread | None = None
        self._stop = False

    def watch(self, entry: Entry, native: torch.futures.Future, timeout: float,
              board: PeerBoard | None, rank: int, world_size: int, value: list,
              on_fail: Callable[[BaseException], BaseException],
              owner: Any = None) -> torch.futures.Future:
        """Return a future that follows ``native`` but fails at the deadline."""
        fut: torch.futures.Future = torch.futures.Future()
        w = _Watched(entry, fut, value, timeout, board, rank, world_size, on_fail, owner)
        with self._lock:
            self._watched.append(w)
            if self._thread is None and not threads.exiting.is_set():
                # It polls every POLL_S: no wake-up per collective.
                self._stop = False
                self._thread = threads.GradringThread("gradring-watchdog", self._loop,
                                                      self._ask_stop)
                self._thread.start()
        native.add_done_callback(lambda f: self._native_done(w, f))
        return fut

    def _native_done(self, w: _Watched, f: torch.futures.Future) -> None:
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            self._settle(w, w.on_fail(exc))
        else:
            self._settle(w, None)

    def _settle(self, w: _Watched, exc: BaseException | None) -> None:
        with self._lock:
            if w.settled:
                return
            w.settled = True
            if w in self._watched:
                self._watched.remove(w)
        final = w.entry.state in ("completed", "failed")
        if exc is None:
            if not final:
                w.entry.finish()
            if w.owner is not None:  # its group's last completed collective (the board's "left")
                w.owner.last_seq = max(w.owner.last_seq, w.entry.seq)
            w.future.set_result(w.value)
        else:
            if not final:
                w.entry.fail(str(exc))
            w.future.set_exception(exc)

    def _check(self, w: _Watched, now: float, seen: dict[int, Any]) -> BaseException | None:
        """The verdict on ``w``, if any; ``seen`` caches board reads within one poll."""
        e = w.entry
        if e.state == "failed":
            return None  # it failed here already: its own error is on the way
        waited = now - (w.deadline - w.timeout)
        board: dict[int, dict[str, Any]] = {}
        if w.board is not None and (waited >= BOARD_AFTER_S or now >= w.deadline):
            fp = e.fingerprint()
            w.board.post("waiting", e.seq, e.describe(), fp=fp)
            if id(w.board) not in seen:
                try:
                    seen[id(w.board)] = (w.board.dead_peers(), w.board.read())
                except StoreValueError as exc:  # a forged value: the verdict, for all its waits
                    seen[id(w.board)] = exc
            if isinstance(seen[id(w.board)], StoreValueError):
                exc = seen[id(w.board)]
                return WatchdogError(f"{type(exc).__name__}: {exc}")
            dead, board = seen[id(w.board)]
            if dead:
                return WatchdogError("; ".join(peers.exited(p, pid) for p, pid in dead))
            for p, status in sorted(board.items()):
                if status["state"] == "waiting" and status["seq"] == e.seq \
                        and status.get("fp") not in (None, fp):
                    differ = desync.difference(fp, status["fp"]) or "fingerprints"
                    return WatchdogError(desync.message(w.rank, e.describe(), p,
                                                        status["what"], differ, e.group),
                                         "DesyncError")
                left = status["state"] == "left" and (status["seq"] < e.seq or (
                    status["seq"] == e.seq and status["why"] == ABANDONED))
                if status["state"] == "failed" or left:
                    cut = w.board.cut_off({p})  # the failed peer's words may be cut short
                    return WatchdogError("; ".join([describe_status(p, status, e.seq), *cut]),
                                         status.get("error", ""))
        if now >= w.deadline:
            cut_off = w.board.store_unreachable() if w.board is not None else None
            if cut_off is not None:
                return WatchdogError(f"timed out after {w.timeout:g}s: {cut_off}, so rank "
                                     f"{w.rank} cannot learn which ranks arrived (a network "
                                     "partition, or the store's host is down)")
            came, missing = arrivals(e.seq, board, w.rank, w.world_size)
            silent = w.board.silent_for if w.board is not None else (lambda p: None)
            notes = "; ".join(describe_status(p, board.get(p), e.seq, silent(p))
                              for p in missing)
            return WatchdogError(f"timed out after {w.timeout:g}s: ranks {came} arrived, "
                                 f"ranks {missing} did not arrive; {notes}")
        return None

    def _loop(self) -> None:
        while True:
            try:
                self._watch_until_idle()
                return
            except Exception as exc:  # noqa: BLE001 - see [Note: the watchdog thread never dies]
                self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every watched collective with ``exc`` (the loop itself broke)."""
        with self._lock:
            pending = list(self._watched)
        for w in pending:
            cause = WatchdogError(f"the watchdog thread failed: {type(exc).__name__}: {exc}")
            cause.__cause__ = exc
            self._fail(w, cause)

    def _watch_until_idle(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._stop:
                    self._thread = None
                    return
                if not self._watched and time.monotonic() - idle_since > _LINGER_S:
                    self._thread = None
                    return
                self._wake.wait(POLL_S)
                watched = list(self._watched)
            now = time.monotonic()
            if watched:
                idle_since = now
            seen: dict[int, Any] = {}
            for w in watched:
                try:
                    cause = self._check(w, now, seen)
                except Exception as exc:  # noqa: BLE001 - see [Note: the watchdog thread never dies]
                    cause = WatchdogError(f"the watchdog could not check this collective: "
                                          f"{type(exc).__name__}: {exc}")
                    cause.__cause__ = exc
                if cause is not None:
                    self._fail(w, cause)

    def _fail(self, w: _Watched, cause: BaseException) -> None:
        """Fail ``w`` with ``on_fail(cause)``; with ``cause`` itself if that raises."""
        try:
            err = w.on_fail(cause)
        except Exception as exc:  # noqa: BLE001 - the future must still end
            err = cause
            err.__context__ = exc
        try:
            self._settle(w, err)
        except Exception:  # noqa: BLE001 - its future was completed meanwhile
            with self._lock:
                if w in self._watched:
                    self._watched.remove(w)

    def cancel(self, owner: Any, reason: str) -> None:
        """Fail what is still watched for ``owner`` (its group is shutting down)."""
        with self._lock:
            pending = [w for w in self._watched if w.owner is owner]
        for w in pending:
            self._settle(w, w.on_fail(RuntimeError(reason)))

    def _ask_stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    def stop(self) -> None:
        """Stop the thread (``comm.shutdown()``, exit, or its ``stop()``); return once it
        is dead. The next watch starts a new one."""
        thread = self._thread
        if thread is not None:
            thread.stop()

    def pending(self) -> list[str]:
        """The collectives still watched, in words."""
        with self._lock:
            return [w.entry.describe() for w in self._watched]


#: The process's one watchdog thread (started on the first watched collective).
WATCHDOG = Watchdog()


def _reset_in_child() -> None:
    """A forked child has none of its parent's threads or pending collectives."""
    WATCHDOG.__init__()  # type: ignore[misc]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
