"""Per-iteration events of the reducer, kept in a fixed-size ring buffer.

The reducer marks a handful of events per bucket per iteration (ready,
launch, comm done, written) plus the backward's start and end; DDP's forward
marks its start, the module's start and end, and its end; every optimizer
step marks its start and end (a process-wide optimizer hook, installed with
the first trace). Each mark is one ``perf_counter`` call and a deque append,
so tracing stays on always. ``gradring.explain`` (tools/explain_record.py) turns
them into a step breakdown.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from typing import Any, NamedTuple

import torch
from torch.autograd.profiler import record_function


class Event(NamedTuple):
    """One timestamped reducer event."""

    iteration: int
    # backward_start | ready | launch | comm_done | written | backward_end (reducer);
    # forward_start | module_start | module_end | forward_end (DDP.forward);
    # optimizer_start | optimizer_end (any torch optimizer's step, see _install_optimizer_marks)
    kind: str
    bucket: int      # -1 for iteration-wide events
    t: float         # time.perf_counter() seconds


#: Every live trace: optimizer steps are marked into each (there is rarely more than one).
_LIVE: weakref.WeakSet[Trace] = weakref.WeakSet()
_OPTIMIZER_HOOKS: list[Any] = []


def _mark_all(kind: str) -> None:
    for trace in list(_LIVE):
        trace.mark(kind)


def _install_optimizer_marks() -> None:
    """Mark every optimizer step's start and end into the live traces (once per process).

    The optimizer runs after the backward's finalize advanced the iteration
    counter, so its marks carry the *next* iteration's number; explain.py
    assigns them to steps by time, not by number."""
    if _OPTIMIZER_HOOKS:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    _OPTIMIZER_HOOKS.append(register_optimizer_step_pre_hook(
        lambda _opt, _args, _kwargs: _mark_all("optimizer_start")))
    _OPTIMIZER_HOOKS.append(register_optimizer_step_post_hook(
        lambda _opt, _args, _kwargs: _mark_all("optimizer_end")))


class Trace:
    """A ring buffer of the most recent reducer events."""

    def __init__(self, capacity: int = 4096) -> None:
        # Fixed capacity: memory stays flat however long training runs.
        self.events: collections.deque[Event] = collections.deque(maxlen=capacity)
        # Iteration number stamped on new events (the reducer advances it).
        self.iteration = 0
        # Internal switch for measuring what tracing costs (``gradring bench ddp``
        # compares both); overlap statistics, timelines and explain need it on.
        self.enabled = True
        _install_optimizer_marks()
        _LIVE.add(self)

    def mark(self, kind: str, bucket: int = -1, iteration: int | None = None) -> None:
        if not self.enabled:
            return
        it = self.iteration if iteration is None else iteration
        self.events.append(Event(it, kind, bucket, time.perf_counter()))

    def iteration_events(self, iteration: int) -> list[Event]:
        return [e for e in self.events if e.iteration == iteration]

    def first(self, iteration: int, kind: str, bucket: int = -1) -> float | None:
        for e in self.events:
            if e.iteration == iteration and e.kind == kind and e.bucket == bucket:
                return e.t
        return None


_profiler_on = getattr(torch._C._autograd, "_profiler_enabled", None)
_QUIET = contextlib.nullcontext()


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """``record_function(name)`` while a torch profiler records, else nothing:
    entering and leaving a record_function costs two dispatched ops (10-150 us
    measured here) even when nobody records."""
    if _profiler_on is None or _profiler_on():
        return record_function(name)
    return _QUIET


def _always() -> bool:
    return True


#: Whether a torch profiler is recording now: torch's own C function where it
#: has one (no Python frame on the bucket launch path), else always.
profiling: Any = _profiler_on if _profiler_on is not None else _always


# [Note: torch's collective events]
# torch's process groups record every collective as a profiler event named
# "<backend>:<op>" ("gloo:all_reduce"), started where it is issued and ended
# when its work completes, on another thread: the profiler reports it as
# asynchronous. Tools (and torch's own DDP tests) count those events.
# gradring's bucket collectives do not go through torch's process group, so
# while a profiler records, the reducer opens one event of that name per
# bucket collective and closes it once the backward has waited for it, from a
# short-lived thread completing a future the events end on, so that it too is
# reported as asynchronous, with its true end; gradring's
# own "gradring::" events stay as they are. Without a profiler nothing is
# opened (one check per bucket launch).
class CollectiveEvents:
    """torch-named profiler events of collectives in flight (see [Note: torch's
    collective events])."""

    def __init__(self) -> None:
        # Events opened and not yet closed, in the order they were opened.
        self._open: list[record_function] = []

    def open(self, name: str) -> None:
        """Start an event named ``name`` (call only while profiling())."""
        event = record_function(name)
        event.__enter__()
        self._open.append(event)

    def close_all(self) -> None:
        """End every open event now, from another thread (the profiler then calls them
        async). They end through a future's completion, as torch's own collectives'
        events do: a record_function merely exited on another thread is given the end of
        the whole profile instead (measured: a 2 ms span reported as 63 ms)."""
        if not self._open:
            return
        events, self._open = self._open, []
        done: torch.futures.Future = torch.futures.Future()
        for event in events:
            event._call_end_callbacks_on_future(done)
        ender = threading.Thread(target=done.set_result, args=(None,),
                                 name="gradring-profiler-events")
        ender.start()
        ender.join()
