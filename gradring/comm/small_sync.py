"""Synchronous small all-reduces, run on the caller's thread with only the per-call work
that must run.

[Note: the small synchronous path]
The most common collective in a training script is a synchronous all-reduce of
a few bytes: a loss or a metric averaged every step. Its data work is nothing;
its cost is the path around it. The general path (``api._issue`` ->
``engine.run_now`` -> ``runner.run``) builds a plan, looks the transport and
the algorithm up and dispatches through the registry on every call.
:meth:`SmallSync.all_reduce` takes a call that needs none of that -- CPU,
contiguous, at most ``select.INLINE_MAX_BYTES``, a reduction gradring does
itself, a plain tensor that does not require grad (a Parameter, autograd's
tensors, a sparse one or a non-tensor take the general path, see [Note:
arguments are checked before the collective is issued] in ``api.py``), no
``GRADRING_TRANSPORT``/``GRADRING_ALGO`` override, shm connected, the group not
failed -- and runs ``direct/inline`` (the algorithm
``select.choose`` picks for it anyway) with every guarantee of the general
path:

- issue order: it runs only when the group's engine is idle (nothing queued
  or running, :meth:`Engine.try_enter`), else the call takes the general path
  and queues behind the asynchronous work issued before it;
- the sequence number, the flight-recorder entry and the desync fingerprint
  (compared in the exchange's descriptors) are the general path's;
- deadline and dead-peer detection live in the shm transport's waits;
- a failure is recorded, posted and completed exactly as on the general path
  (``runner._failed``).

It is the general path minus lookups, so it gives the same bits: the tests
run every small case both ways (``tests/jobs/test_small_sync.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gradring.comm import ops, runner, select
from gradring.comm.recorder import RECORDER
from gradring.comm.transport import Kind

if TYPE_CHECKING:
    from gradring.comm.context import GroupContext

_DTYPES = frozenset(ops.REDUCE_DTYPES)


class SmallSync:
    """One group's synchronous small all-reduces over its shm transport."""

    def __init__(self, ctx: GroupContext, transport: Any) -> None:
        # The group's state (engine, sequence numbers, failures) and its shm transport.
        self._ctx = ctx
        self._transport = transport

    def serves(self, transport: Any) -> bool:
        """Whether this runs over ``transport`` (a fallback or reconnect replaces it)."""
        return transport is self._transport

    def all_reduce(self, tensor: torch.Tensor, op: Any, label: str | None = None) -> bool:
        """Run ``all_reduce(tensor, op)`` here and return True, or return False having
        done nothing (the caller takes the general path)."""
        try:  # no cost unless it raises (3.11's exceptions): the 8-byte floor
            if tensor.requires_grad or not tensor.is_cpu or tensor.dtype not in _DTYPES:
                return False  # a Parameter, autograd's: written through .data (api.py)
            # (a sparse tensor is not contiguous: the general path hands it to gloo)
            nbytes = tensor.numel() * tensor.element_size()
            if not 0 < nbytes <= select.INLINE_MAX_BYTES or not tensor.is_contiguous():
                return False
        except (AttributeError, RuntimeError):
            return False  # not a tensor, a layout without strides: see api.py
        try:
            mine = ops.BY_VALUE.get(op)
        except TypeError:  # an unhashable custom op: the general path says what is wrong
            return False
        env = select.overrides()
        ctx, transport = self._ctx, self._transport
        if mine is None or env.transport is not None or env.algo is not None \
                or ctx.failures.broken is not None or not transport.usable():
            return False
        engine = ctx.engine
        if not engine.try_enter():
            return False
        try:
            entry = RECORDER.issue(ctx.name, ctx.next_seq(), Kind.ALL_REDUCE, nbytes,
                                   tensor.dtype, tensor.shape, label=label)
            runner.run_small_all_reduce(ctx, entry, transport, tensor, mine)
        finally:
            engine.leave()
        return True
