"""The one slow-backward fixture of the "overlap is real" tests, held by events.

[Note: overlap by events, not durations]
An earlier fixture slept 80-300 ms in the backward of an early layer and
asserted that a later bucket's all-reduce finished with some slack before the
backward's end. On a loaded machine a collective can take longer than any
such sleep, so the test flaked. Here the early layer's backward *holds* until
the trace shows the late bucket's all-reduce done (`until_reduced`), and the
tests assert the order of the trace's events: the late bucket was launched
and its collective completed before the early layer's gradient was ready and
before the backward ended. When buckets do not launch during the backward
(the broken case), that all-reduce cannot complete while the backward is
held: the hold gives up after `HOLD_LIMIT_S` (a bound on a failing test's wait,
never a pass/fail threshold) and the order assertion fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

#: The longest a held backward waits for the all-reduce it holds for. Only a
#: broken reducer ever reaches it; the test then fails on the events' order.
HOLD_LIMIT_S = 60.0

#: What the early layer's backward runs before it returns; None: nothing.
_HOLD: dict[str, Callable[[], None] | None] = {"wait": None}


@torch._dynamo.disable
def _held() -> None:
    wait = _HOLD["wait"]
    if wait is not None:
        wait()


class _Hold(torch.autograd.Function):
    """Identity forward; its backward runs the armed hold, if any."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        _held()
        return g


@torch._dynamo.disable
def hold(x: torch.Tensor) -> torch.Tensor:
    return _Hold.apply(x)


class HeldEarly(nn.Module):
    """An early layer whose backward can be held, under a 1 MiB late layer.

    With the default caps the rebuilt first bucket (1 MiB) takes the late layer
    alone and the early layer goes into the next one (an explicit bucket_cap_mb
    is the first bucket's cap too, as in torch 2.13)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.early = nn.Linear(64, 512)
        self.late = nn.Linear(512, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late(hold(self.early(x)))


def _done(trace, iteration: int, bucket: int) -> bool:  # noqa: ANN001
    # list() copies the deque in one C call: the comm thread may append meanwhile.
    return any(e.iteration == iteration and e.kind == "comm_done" and e.bucket == bucket
               for e in list(trace.events))


def until_reduced(ddp, bucket: int) -> Callable[[], None]:  # noqa: ANN001
    """A hold that returns once ``bucket``'s all-reduce of the running iteration
    is done (or after HOLD_LIMIT_S, when it never completes)."""
    trace = ddp.reducer.trace

    def wait() -> None:
        it = trace.iteration
        give_up = time.monotonic() + HOLD_LIMIT_S
        while not _done(trace, it, bucket) and time.monotonic() < give_up:
            time.sleep(0.001)

    return wait


def held_backward(ddp, run: Callable[[], None], bucket: int) -> None:  # noqa: ANN001
    """Run one forward and backward (``run``) with the early layer held until
    ``bucket``'s all-reduce is done."""
    _HOLD["wait"] = until_reduced(ddp, bucket)
    try:
        run()
    finally:
        _HOLD["wait"] = None


def event_order(ddp, iteration: int) -> list[tuple[str, int]]:  # noqa: ANN001
    """The reducer events of one iteration as (kind, bucket), in time order."""
    evs = sorted((e for e in list(ddp.reducer.trace.events) if e.iteration == iteration),
                 key=lambda e: e.t)
    return [(e.kind, e.bucket) for e in evs]


def launched_and_done_during_backward(order: list[tuple[str, int]], bucket: int,
                                      later: int) -> bool:
    """Whether ``bucket`` was launched and its all-reduce done before bucket
    ``later`` became ready and before the backward ended."""
    def at(kind: str, b: int) -> int:
        return order.index((kind, b)) if (kind, b) in order else len(order)

    done = at("comm_done", bucket)
    return at("launch", bucket) < done < min(at("ready", later), at("backward_end", -1))
