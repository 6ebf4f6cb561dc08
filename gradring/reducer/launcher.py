"""Launching buckets in index order, and reducing or waiting for each at the finalize.

[Note: in-order launch]
Buckets launch strictly in index order, as in torch's DDP: a ready bucket
waits until every lower bucket has launched, then all ready ones go
together. Every rank issues the same collectives in the same order, so they
pair up whatever order the gradients arrived in. A launch is asynchronous:
the group's comm thread runs the collective while autograd computes the
earlier layers. Each is labelled ``DDP bucket <k>`` for errors, desync checks
and the flight recorder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from gradring.buckets import Bucket, BucketState
from gradring.buckets.grad_bucket import GradBucket
from gradring.group_comm import GroupComm
from gradring.observe.trace import CollectiveEvents, Trace, profiled, profiling

CommHook = Callable[[Any, GradBucket], torch.futures.Future]

_READY = BucketState.READY


class Launcher:
    """Issues one backward's bucket collectives in index order, and ends each one."""

    def __init__(self, comm: GroupComm, trace: Trace,
                 on_failure: Callable[[Bucket, Exception], RuntimeError]) -> None:
        self._comm = comm
        self._trace = trace
        # Turns a failed collective into the error to raise (names the bucket).
        self._on_failure = on_failure
        # Next bucket index to launch in this backward.
        self.next_bucket = 0
        # Indices of this backward's buckets that are not reduced ([Note: skipped buckets]
        # in unused.py).
        self._skipped: frozenset[int] = frozenset()
        # Profiler events named as torch's process group names its collectives
        # (see [Note: torch's collective events] in observe/trace.py) ...
        self._events = CollectiveEvents()
        # ... and the names, for this group's backend.
        self._event_names = _collective_event_names(comm)
        # The comm hook and its state, when one is set.
        self.comm_hook: CommHook | None = None
        self.comm_hook_state: Any = None

    @property
    def broadcast_event(self) -> str:
        """The profiler name of a broadcast over this group."""
        return self._event_names[1]

    def begin(self, *, skipped: frozenset[int]) -> None:
        """A new backward: which buckets are skipped."""
        self.next_bucket = 0
        self._skipped = skipped

    def launch_ready(self, buckets: list[Bucket], scale: float) -> list[int]:
        """Launch every ready bucket whose lower buckets have launched; the
        indices of those reduced (skipped ones are not)."""
        last = len(buckets) - 1
        reduced = []
        while self.next_bucket <= last and buckets[self.next_bucket].state is _READY:
            k = self.next_bucket
            bucket = buckets[k]
            self.next_bucket = k + 1
            if k in self._skipped:
                bucket.launch(_holding(bucket.buffer))
                continue
            reduced.append(k)
            bucket.launch(self.reduce(bucket, scale, is_last=k == last))
        return reduced

    def use(self, comm: GroupComm) -> None:
        """Issue later collectives through ``comm`` (the reducer's changed)."""
        self._comm = comm

    def reduce(self, bucket: Bucket, scale: float, *, is_last: bool = False) -> Any:
        """Issue the bucket's collective; the future resolves to the reduced flat buffer."""
        index, trace = bucket.index, self._trace
        trace.mark("launch", index)
        label = f"DDP bucket {index}"
        if profiling():
            self._events.open(self._event_names[0])
        comm = self._comm
        try:
            with profiled(f"gradring::bucket_all_reduce#{index}"):
                out = None
                for path in bucket.paths:  # a fast path may reduce it its own way
                    out = path.reduce(comm, bucket, scale, label)
                    if out is not None:
                        break
                if out is not None:
                    pass
                elif self.comm_hook is None:
                    out = comm.all_reduce(bucket.buffer, label=label, async_op=True)
                else:
                    gb = GradBucket(bucket, is_last=is_last)
                    with comm.labelled(label):
                        out = self.comm_hook(self.comm_hook_state, gb)
        except Exception as exc:
            raise self._on_failure(bucket, exc) from exc
        # The completion is marked by the thread that completes the collective,
        # and the future the finalize waits for completes only after that mark:
        # a done-callback on ``out`` itself could still be running when the wait
        # returns, and the iteration's trace would miss its end.
        return out.then(functools.partial(_mark_done, trace, index, trace.iteration))

    def result(self, bucket: Bucket) -> torch.Tensor:
        """The finalize: the bucket's reduced values; a failure names the bucket."""
        try:
            value = bucket.future.wait()
        except Exception as exc:
            raise self._on_failure(bucket, exc) from exc
        return value[0] if isinstance(value, (list, tuple)) else value

    def drain(self, buckets: list[Bucket]) -> None:
        """Finish every collective this backward issued, ignoring failures, so
        that none is left dangling for the peers."""
        for b in buckets:
            try:
                if b.future is not None:
                    b.future.wait()
            except Exception:  # noqa: BLE001 - the caller reports what matters
                pass

    def close_events(self) -> None:
        """Close the profiler events of this backward's collectives."""
        self._events.close_all()


def _mark_done(trace: Trace, index: int, iteration: int, fut: torch.futures.Future) -> Any:
    """Bucket ``index``'s collective of ``iteration`` completed: trace it, pass its value on."""
    trace.mark("comm_done", index, iteration)
    return fut.value()


def _holding(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _collective_event_names(comm: GroupComm) -> tuple[str, str]:
    """The profiler names of an all-reduce and a broadcast over ``comm``'s group
    as torch's process group records them (see [Note: torch's collective events])."""
    try:
        backend = str(torch.distributed.get_backend(comm.group))
    except (RuntimeError, ValueError, AttributeError):
        backend = "gradring"
    return f"{backend}:all_reduce", f"{backend}:broadcast"
