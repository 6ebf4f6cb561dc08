"""The async engine: collectives of one group run in issue order, off the caller's thread.

[Note: one engine per group]
Each process group gets one engine. ``async_op=True`` queues the collective
and returns a :class:`Work` at once; the engine thread runs jobs strictly in
issue order (so every rank pairs its collectives the same way) and completes
each job's future with its result or exception, so a failure always reaches
``wait()``, never dies in a thread; future callbacks run on that thread, as on
the backend's thread in torch. A synchronous call (:meth:`Engine.run_now`)
runs on the caller's thread when the engine is idle -- the thread hand-off is
most of a small collective's latency -- and otherwise waits its turn. Engines
of different groups are independent. The thread starts with the first queued
job, is a ``GradringThread`` ([Note: gradring's threads]) and is joined at
the group's end and at exit ([Note: how a gradring process exits]).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import NamedTuple

import torch

from gradring.comm import leaving  # noqa: F401 - its atexit step must be registered first
from gradring.comm.threads import GradringThread


class Job(NamedTuple):
    """One queued collective."""

    run: Callable[[], None]  # performs the collective; raises on failure
    future: torch.futures.Future  # completed with ``value`` or the exception
    value: list[torch.Tensor]  # what the future resolves to (torch: ``[tensor]``)


class Work:
    """Handle of one issued collective, with the methods of torch's ``Work``."""

    def __init__(self, future: torch.futures.Future, engine: Engine | None = None) -> None:
        # Completed by the engine; what get_future() returns.
        self._future = future
        # The engine running it, so waiting from its own thread can help instead of deadlock.
        self._engine = engine

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until done; re-raise the collective's exception. Returns True."""
        if not self._future.done() and self._engine is not None:
            self._engine.help_until(self._future)
        if timeout is not None and not self._future.done():
            secs = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            if not done.wait(secs):
                raise RuntimeError(f"gradring: Work.wait timed out after {secs:g}s")
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except BaseException as exc:  # noqa: BLE001 - this is the query
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()

    def __repr__(self) -> str:
        return f"<gradring Work {'done' if self.is_completed() else 'pending'}>"


def failed(exc: BaseException) -> Work:
    """A Work that has already failed with ``exc`` (raised at ``wait()``)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(exc)
    return Work(fut)


def completed(value: list[torch.Tensor]) -> Work:
    """A Work that is already done (world size 1, empty collectives)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return Work(fut)


class Engine:
    """Runs one group's jobs in issue order; see [Note: one engine per group]."""

    def __init__(self, name: str) -> None:
        # Thread name, to find it in stack dumps.
        self._name = name
        # One lock guards the queue and the busy flag, with two conditions on it:
        # ``_work`` wakes the engine thread (a job queued, the engine free, or
        # closing); ``_idle`` wakes callers waiting for the engine to be free. Kept
        # apart so that a synchronous call ending inline does not wake the idle
        # engine thread each time: that wake-up measured 2-4x the latency of a
        # 4-byte all-reduce (27 us against 60-130 us).
        lock = self._lock = threading.Lock()
        self._work = threading.Condition(lock)
        self._idle = threading.Condition(lock)
        # Callers waiting on ``_idle`` (run_now): ending an inline call notifies
        # only when there are some.
        self._idle_waiters = 0
        # Jobs issued and not yet started, oldest first.
        self._queue: deque[Job] = deque()
        # True while a job runs (on the engine thread or inline on a caller's).
        self._busy = False
        # The background thread, started by the first queued job (again after a stop()).
        self._thread: GradringThread | None = None
        # Set by shutdown(): the thread exits once the queue is empty.
        self._closing = False
        # Set by the thread's stop(): it exits once the queue is empty; the next job
        # starts a new one.
        self._stopping = False

    def submit(self, job: Job) -> None:
        with self._work:
            if self._closing:
                raise RuntimeError(f"gradring: engine {self._name} is shut down")
            self._queue.append(job)
            if self._thread is None:
                self._thread = GradringThread(self._name, self._loop, self._ask_stop)
                self._thread.start()
            self._work.notify()

    def run_now(self, run: Callable[..., None], *args: object) -> None:
        """Run ``run(*args)`` on this thread after every job issued before it: the
        synchronous calls' one entry, the small path's included (so the lock itself,
        not its conditions, where nothing waits: this runs once per small call)."""
        if threading.current_thread() is self._thread:
            fut: torch.futures.Future = torch.futures.Future()
            self.submit(Job(lambda: run(*args), fut, []))
            self.help_until(fut)
            fut.wait()
            return
        lock = self._lock
        lock.acquire()
        try:
            while self._busy or self._queue:
                self._idle_waiters += 1
                try:
                    self._idle.wait()
                finally:
                    self._idle_waiters -= 1
            self._busy = True
        finally:
            lock.release()
        try:
            run(*args)
        finally:
            lock.acquire()
            try:
                self._busy = False
                if self._idle_waiters:
                    self._idle.notify()
                if self._queue:
                    self._work.notify()
            finally:
                lock.release()

    def busy(self) -> bool:
        """Whether a job is queued or running (a racy peek: :meth:`run_now` decides)."""
        return self._busy or bool(self._queue) or threading.current_thread() is self._thread

    def help_until(self, fut: torch.futures.Future) -> None:
        """On the engine thread itself (a callback waiting on a later job), run
        queued jobs here until ``fut`` is done, instead of deadlocking."""
        if threading.current_thread() is not self._thread:
            return
        while not fut.done():
            with self._work:
                if not self._queue:
                    return
                job = self._queue.popleft()
            self._execute(job)

    def _execute(self, job: Job) -> None:
        try:
            job.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            job.future.set_exception(exc)
        else:
            job.future.set_result(job.value)

    def _ask_stop(self) -> None:
        with self._work:
            if self._thread is not None:
                self._stopping = True
                self._work.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the engine thread once the queued jobs ran; return once it is dead.
        The next queued job starts a new one."""
        thread = self._thread
        if thread is not None:
            thread.stop(timeout)

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._work:
                while (not self._queue or self._busy) and not (self._closing or self._stopping):
                    self._work.wait()
                if not self._queue:
                    if self._thread is me:
                        self._thread = None
                        self._stopping = False
                    return
                while self._busy:  # closing: still never beside an inline call
                    self._work.wait()
                job = self._queue.popleft()
                self._busy = True
            try:
                self._execute(job)
            finally:
                with self._work:
                    self._busy = False
                    self._idle.notify_all()

    def alive(self) -> bool:
        """Whether the engine thread still runs (e.g. blocked inside a collective)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def pending(self) -> int:
        with self._work:
            return len(self._queue) + int(self._busy)

    def thread(self) -> GradringThread | None:
        """The engine thread, if one runs."""
        return self._thread

    def abandon(self, reason: str) -> None:
        """Stop taking jobs and fail the queued ones with ``reason`` (the process exits:
        the job running now, if any, is left to end or be aborted by the caller)."""
        with self._work:
            self._closing = True
            leftover = list(self._queue)
            self._queue.clear()
            self._work.notify_all()
        for job in leftover:
            job.future.set_exception(RuntimeError(f"gradring: {self._name}: {reason}"))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Let queued jobs finish (up to ``timeout``), then stop the thread."""
        with self._work:
            self._closing = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        deadline = time.monotonic() + 0.1
        with self._work:
            leftover = list(self._queue)
            self._queue.clear()
        for job in leftover:
            job.future.set_exception(RuntimeError(f"gradring: {self._name} shut down"))
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
