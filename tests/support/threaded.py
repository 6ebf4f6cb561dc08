"""An in-process transport: every rank is a thread. For fast tests of the algorithms
(it serves only the tests, so it lives with them, outside the package).

It offers both interfaces of :mod:`gradring.comm.transport`: point-to-point
messages through per-pair queues (``isend`` copies, so it completes at once)
and direct access (threads share memory, so an exposed tensor *is* the view a
peer reads). Staging, alternating buffer sets, barriers and descriptor checks
follow the shared-memory transport, so the direct algorithms meet the same
hazards here as in production.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import Collective, CollectiveError, Exchange


class _Recv:
    """A posted receive: where the bytes go and how they combine."""

    __slots__ = ("buf", "src", "op", "done")

    def __init__(self, buf: torch.Tensor, src: int, op: Op | None) -> None:
        self.buf = buf  # destination view
        self.src = src  # sending rank
        self.op = op  # None: overwrite; else buf = buf (op) incoming
        self.done = False  # set once the message has been consumed


_SENT = object()  # isend completes immediately: the payload was copied


class ThreadedWorld:
    """State shared by the ``world_size`` thread-ranks of one test."""

    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        # Number of thread-ranks.
        self.world_size = world_size
        # Seconds any wait may take before the collective fails.
        self.timeout = timeout
        # One FIFO per ordered (src, dst) pair, like a socket.
        self.queues = {(s, d): queue.Queue() for s in range(world_size)
                       for d in range(world_size) if s != d}
        # Guards the barrier counters and published descriptors.
        self.cond = threading.Condition()
        # How many barriers each rank has arrived at (shm: its futex word).
        self.arrivals = [0] * world_size
        # Two alternating descriptor slots per rank (shm: control segment).
        self.published: list[list[Any]] = [[None, None] for _ in range(world_size)]
        # (start, end) address ranges handed out by :meth:`empty`: "transport memory".
        self.memory: list[tuple[int, int, torch.Tensor]] = []

    def transport(self, rank: int) -> ThreadedTransport:
        return ThreadedTransport(self, rank)

    def empty(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor the direct algorithms treat as zero-copy (like ``comm.empty``)."""
        t = torch.empty(numel, dtype=dtype)
        with self.cond:
            self.memory.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t))
        return t

    def owns(self, t: torch.Tensor) -> bool:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return t.numel() > 0 and any(a <= lo and hi <= b for a, b, _ in self.memory)


class ThreadedTransport:
    """One thread-rank's view of a :class:`ThreadedWorld`."""

    name = "threaded"

    def __init__(self, world: ThreadedWorld, rank: int) -> None:
        # The shared state of all thread-ranks.
        self.world = world
        # This rank and the number of ranks, as the algorithms expect them.
        self.rank = rank
        self.world_size = world.world_size
        # Barriers this rank has passed or announced.
        self._epoch = 0
        # Exchanges done so far; selects the staging set and descriptor slot.
        self._exchanges = 0
        # Two staging byte buffers, grown on demand (see [Note: direct algorithms]).
        self._staging = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        # Receives posted but not yet consumed, per source, in posting order.
        self._pending: dict[int, deque[_Recv]] = {p: deque() for p in range(world.world_size)}
        # The collective in flight, for error messages, and its deadline.
        self._info: Collective | None = None
        self._deadline = 0.0

    # -- lifecycle -------------------------------------------------------------
    def start(self, info: Collective) -> None:
        self._info = info
        self._deadline = time.monotonic() + self.world.timeout

    def close(self) -> None:
        self._staging = []

    def _fail(self, what: str) -> CollectiveError:
        desc = self._info.describe() if self._info else "collective"
        return CollectiveError(f"gradring {desc} on rank {self.rank}: {what}")

    def _left(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._fail(f"timed out after {self.world.timeout}s")
        return left

    # -- point to point --------------------------------------------------------
    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        self.world.queues[(self.rank, dst)].put(buf.clone())
        return _SENT

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        req = _Recv(buf, src, op)
        self._pending[src].append(req)
        return req

    def wait_all(self, reqs: Sequence[Any]) -> None:
        for req in reqs:
            if req is _SENT:
                continue
            while not req.done:  # consume earlier receives from the same peer first
                head = self._pending[req.src].popleft()
                try:
                    data = self.world.queues[(head.src, self.rank)].get(timeout=self._left())
                except queue.Empty:
                    raise self._fail(f"rank {head.src} did not send") from None
                if data.numel() != head.buf.numel():
                    raise self._fail(f"rank {head.src} sent {data.numel()} elements, "
                                     f"expected {head.buf.numel()}")
                if head.op is None:
                    ops.copy(head.buf, data)
                else:
                    ops.combine(head.buf, head.buf, data, head.op)
                head.done = True

    # -- direct access ---------------------------------------------------------
    def expose(self, flat: torch.Tensor, *,
               force_staging: bool = False) -> tuple[torch.Tensor, bool]:
        if not force_staging and self.world.owns(flat):
            return flat, True
        nbytes = flat.numel() * flat.element_size()
        k = self._exchanges % 2
        if self._staging[k].numel() < nbytes:
            self._staging[k] = torch.empty(max(nbytes, 2 * self._staging[k].numel()),
                                           dtype=torch.uint8)
        return self._staging[k][:nbytes].view(flat.dtype), False

    def exchange(self, info: Collective, exposed: torch.Tensor | None, *,
                 zero_copy: bool) -> Exchange:
        slot = self._exchanges % 2
        self._exchanges += 1
        mine = (info.seq, info.kind, info.nbytes)
        self.world.published[self.rank][slot] = (mine, exposed, zero_copy)
        self.barrier()
        entries = [self.world.published[p][slot] for p in range(self.world_size)]
        for p, (theirs, _, _) in enumerate(entries):
            if theirs != mine:
                raise self._fail(f"rank {p} is in a different collective: "
                                 f"(seq, kind, bytes) {theirs} != {mine}")
        return Exchange([e[1] for e in entries], any(e[2] for e in entries))

    def exchange_inline(self, info: Collective, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of its ``flat``, in rank order (a staged exchange here)."""
        flat1 = flat.view(-1)
        mine, _ = self.expose(flat1, force_staging=True)
        ops.copy(mine, flat1)
        views = self.exchange(info, mine, zero_copy=False).views
        return [v.view(flat.shape) for v in views if v is not None]

    def arrive(self) -> None:
        self._epoch += 1
        with self.world.cond:
            self.world.arrivals[self.rank] = self._epoch
            self.world.cond.notify_all()

    def wait_arrivals(self) -> None:
        self._wait_for(self.world.arrivals, self._epoch, "arrive")

    def _wait_for(self, counters: list[int], target: int, what: str,
                  ranks: Sequence[int] | None = None) -> None:
        with self.world.cond:
            while True:
                late = [p for p in (ranks if ranks is not None else range(self.world_size))
                        if counters[p] < target]
                if not late:
                    return
                left = self._deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(f"ranks {late} did not {what} within {self.world.timeout}s")
                self.world.cond.wait(timeout=min(left, 0.5))

    def barrier(self) -> None:
        self.arrive()
        self.wait_arrivals()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
              world: ThreadedWorld | None = None, timeout: float = 60.0) -> list[Any]:
    """Run ``fn(transport, *args)`` on ``world_size`` thread-ranks; return their results.

    The first exception of any rank is re-raised (with its rank in the message).
    """
    world = world or ThreadedWorld(world_size, timeout=timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.transport(rank), *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append((rank, exc))

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 5)
    if any(th.is_alive() for th in threads):
        raise CollectiveError(f"threaded ranks still running after {timeout + 5}s")
    if errors:
        rank, exc = min(errors, key=lambda e: e[0])
        raise CollectiveError(f"rank {rank} failed: {exc!r}") from exc
    return results
