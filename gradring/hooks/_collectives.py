"""The few collective helpers every hook shares.

Hooks talk to ``gradring.comm`` only through these functions, which count the
bytes (``stats.py``) and turn the work objects into futures of the tensor itself.

[Note: launch order of chained collectives]
Collectives are matched across ranks by the order in which each rank issues
them. A hook that needs two rounds (PowerSGD: P, then Q computed from the
reduced P) issues its second round from a future callback, and callbacks may
run on a transport thread at any moment. Meanwhile the reducer's thread goes on
calling the hook for the next bucket, whose first round could then be issued
before the previous bucket's second round on one rank and after it on another:
the ranks would pair the wrong collectives. ``LaunchSequencer`` prevents this:
a multi-round hook registers a marker that is completed once its last round is
issued, and every hook call first waits for the previous markers. The last
bucket of an iteration waits for its own marker before returning, so nothing
the reducer issues after the hooks (e.g. the unused-parameter map) can slip in
between. Waiting costs only the first round's latency, never the last.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradring import comm
from gradring.hooks.stats import comm_stats

Future = torch.futures.Future
#: How hooks annotate their bucket and result. torch's DDP compares these
#: annotations by identity (so the hook modules do not use postponed
#: annotations); any object with GradBucket's methods works as a bucket.
GradBucket: Any = getattr(dist, "GradBucket", Any)
HookResult = torch.futures.Future[torch.Tensor]
# What ``Future.then`` returns is the C++ base class, not torch.futures.Future.
_ANY_FUTURE = torch._C.Future


def world_size_of(group: Any) -> int:
    """Size of ``group`` (None: the default group); 1 when nothing is initialised."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def offsets_in(flat: torch.Tensor, views: list[torch.Tensor]) -> list[int]:
    """Element offset of each of a bucket's ``gradients()`` inside its flat ``buffer()``.

    Read from the storage when they are views of it (torch's GradBucket and
    gradring's are); otherwise assume they are packed back to back, in order.
    """
    try:
        base = flat.untyped_storage().data_ptr()
        same = all(v.untyped_storage().data_ptr() == base for v in views)
    except RuntimeError:  # tensors without a storage
        same = False
    if same:
        return [v.storage_offset() - flat.storage_offset() for v in views]
    offsets, at = [], 0
    for v in views:
        offsets.append(at)
        at += v.numel()
    return offsets


def views_of(flat: torch.Tensor, bucket: Any) -> list[torch.Tensor]:
    """One view of ``flat`` per gradient of ``bucket``, shaped like that gradient."""
    per_param = bucket.gradients()
    offsets = offsets_in(bucket.buffer(), per_param)
    return [flat[o:o + g.numel()].view(g.shape) for o, g in zip(offsets, per_param)]


def completed(value: Any) -> Future:
    """A future that already holds ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class _NoWork:
    """Stands in for the work of a collective that had nothing to move."""

    __slots__ = ("_fut",)

    def __init__(self, value: Any) -> None:
        self._fut = completed([value])

    def wait(self) -> bool:
        return True

    def get_future(self) -> Future:
        return self._fut


def _resolve_to(work: Any, tensor: torch.Tensor) -> Future:
    """A future of ``tensor`` itself, completed when ``work`` is (errors propagate)."""

    def unwrap(f: Future) -> torch.Tensor:
        f.value()  # re-raises a failed collective
        return tensor

    return work.get_future().then(unwrap)


def all_reduce(tensor: torch.Tensor, group: Any, *, label: str) -> tuple[Any, Future]:
    """Start a SUM all-reduce of ``tensor`` in place; return (work, future of ``tensor``)."""
    if tensor.numel() == 0:  # every rank has the same layout, so all skip alike
        work: Any = _NoWork(tensor)
        return work, _resolve_to(work, tensor)
    world = world_size_of(group)
    comm_stats().record(label, "all_reduce", tensor.numel() * tensor.element_size(), world)
    work = comm.all_reduce(tensor, group=group, async_op=True)
    return work, _resolve_to(work, tensor)


def mean_all_reduce(tensor: torch.Tensor, group: Any, *, label: str) -> Future:
    """Average ``tensor`` in place: scale by 1/N, then SUM all-reduce.

    Scaling multiplies by ``1.0 / N`` (not divides), exactly as the reducer
    scales gradients when no hook is registered, so the results are bitwise
    identical to having no hook.
    """
    world = world_size_of(group)
    if world != 1:
        tensor.mul_(1.0 / world)
    return all_reduce(tensor, group, label=label)[1]


def all_gather(output: torch.Tensor, inp: torch.Tensor, group: Any, *,
               label: str) -> tuple[Any, Future]:
    """Start gathering every rank's ``inp`` into ``output`` (rank-major); future of ``output``."""
    if inp.numel() == 0:
        work: Any = _NoWork(output)
        return work, _resolve_to(work, output)
    world = world_size_of(group)
    comm_stats().record(label, "all_gather", inp.numel() * inp.element_size(), world)
    work = comm.all_gather_into_tensor(output, inp, group=group, async_op=True)
    return work, _resolve_to(work, output)


def chain(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """Like ``fut.then(fn)``, but ``fn`` may return a Future, which is followed, not nested.

    Unlike calling ``.wait()`` inside a ``then`` callback, this never blocks the
    thread that completed ``fut`` (which may be the transport's only thread).
    """
    out: Future = Future()

    def settle(inner: Future) -> None:
        try:
            out.set_result(inner.value())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)

    def step(f: Future) -> None:
        try:
            result = fn(f.value())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)
            return
        if isinstance(result, _ANY_FUTURE):
            result.add_done_callback(settle)
        else:
            out.set_result(result)

    fut.add_done_callback(step)
    return out


class LaunchSequencer:
    """Keeps chained rounds of collectives in the same order on every rank.

    See [Note: launch order of chained collectives].
    """

    __slots__ = ("_lock", "_pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (work of the first round, marker completed once the last round is issued)
        self._pending: list[tuple[Any, Future]] = []

    def register(self, first_round: Any, marker: Future) -> None:
        with self._lock:
            self._pending.append((first_round, marker))

    def wait_for_launches(self) -> None:
        """Block until every registered chain has issued all of its collectives."""
        with self._lock:
            pending, self._pending = self._pending, []
        for work, marker in pending:
            # Waiting on the work first lets a transport that progresses only
            # inside wait() run; the marker is set by the callback that follows.
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - the failure reaches the hook's own future
                pass
            marker.wait()


_SEQUENCER = LaunchSequencer()


def sequencer() -> LaunchSequencer:
    return _SEQUENCER
