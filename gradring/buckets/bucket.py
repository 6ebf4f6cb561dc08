"""The flat-buffer Bucket: its slots, their kinds, and its transitions within one backward."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch


class SlotKind(enum.Enum):
    """How one parameter's gradient travels through its bucket slot.

    [Note: slot kinds]
    Decided once per bucket, when it is installed (and again if a comm hook is
    registered), so the per-gradient hook follows a stored decision: each
    fast path (in ``gradring/fast_paths.py``'s order) claims the slots it
    takes, the core the rest. The core's two kinds (see [Note: the core and its fast paths] in
    ``gradring/fast_paths.py``):

    - ``COPIED``: copied into the slot by its hook and the result copied back
      out by the finalize;
    - ``VIEW``: gradient_as_bucket_view; ``.grad`` *is* the slot.

    and the fast paths' two:

    - ``HOMED`` (fast path ``homed``): the gradient stays in ``.grad``; the
      collective reads the own chunk from it and writes the result back into
      it ([Note: external parts] in ``comm/external.py``);
    - ``PACKED`` (fast path ``packed``): a small slot outside view mode;
      copied in and out like ``COPIED``, but a bucket's small slots at a
      time when the bucket is ready ([Note: packed slots] in ``packing.py``).

    PACKED slots are *deferred*: their hooks only count, and the tensor work
    is done for the whole bucket when its last gradient arrives. Each fast
    path's state and code is its own object (``homed.py``, ``packed.py``).

    A gradient that does not fit its slot's kind at run time (no gradient,
    a non-contiguous or sparse one) falls back to ``COPIED``.
    """

    VIEW = "view"
    HOMED = "homed"
    COPIED = "copied"
    PACKED = "packed"


class BucketState(enum.Enum):
    """Where a bucket is in one backward pass."""

    FILLING = "filling"    # waiting for some of its gradients
    READY = "ready"        # every gradient copied in; waiting for lower buckets to launch
    LAUNCHED = "launched"  # its collective (or comm hook) is in flight


class Bucket:
    """A flat buffer holding the gradients of several parameters, plus the views into it."""

    def __init__(
        self,
        index: int,
        param_indices: list[int],
        params: list[torch.Tensor],
        allocate: Callable[[int, torch.dtype, torch.device], torch.Tensor],
    ) -> None:
        # Position in launch order; bucket 0 launches first.
        self.index = index
        # Global (definition-order) indices of the parameters held here.
        self.param_indices = param_indices
        # The parameters themselves, in slot order.
        self.params = params
        # Elements per slot, and the parameters' shapes (what the slot views take).
        self.numels = [p.numel() for p in params]
        self.shapes = [p.shape for p in params]
        # Element offset of each slot inside the flat buffer.
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        # Allocates the flat buffer (comm.empty: shared memory on one host).
        self._allocate = allocate
        self.buffer, self.views = self._make_buffer()
        # [Note: a bucket's transitions]
        # Within one backward a bucket goes FILLING -> READY -> LAUNCHED and back
        # to FILLING at reset(). Only its own methods change the fields below:
        # arrive() counts a gradient in, mark_ready(), launch(),
        # complete() once its results are written, reset() for the next
        # backward; write_back() records the slots the core writes back. The
        # others read them.
        # Gradients still missing in this backward, out of ``size``, less the
        # counted slots (see [Note: counted slots] in packed.py), which are
        # counted by their path's list instead.
        self.size = len(params)
        self.pending = self.size
        # The paths that count some slots without a Python hook, and how many.
        self.counting: tuple[Any, ...] = ()
        self.n_counted = 0
        # Lifecycle within one backward.
        self.state = BucketState.FILLING
        # Future of the in-flight collective; resolves to the reduced flat tensor.
        self.future: Any = None
        # This backward's slots whose result the core copies back into .grad
        # at the end (copied in, or no gradient); the fast paths write their
        # own. The list is cleared in place, never replaced, so that
        # write_back stays its bound append.
        self.to_write: list[int] = []
        # Records a slot in to_write: the list's own append, so that a put
        # costs no Python call more per gradient (see [Note: the per-gradient
        # path] in reducer/reducer.py).
        self.write_back: Callable[[int], None] = self.to_write.append
        # Per slot, how its gradient travels (see [Note: slot kinds]).
        self.kinds: list[SlotKind] = [SlotKind.COPIED] * len(params)
        # The fast paths that hold some of its slots, and what of theirs runs
        # when the bucket is full, reduces it, and writes back (see place()).
        self.paths: tuple[Any, ...] = ()
        self.on_full: tuple[Callable[[Bucket, float], None], ...] = ()
        self.path_writes: tuple[Callable[[Bucket, list[int] | None], None], ...] = ()

    # ------------------------------------------------- one backward's transitions
    def arrive(self) -> bool:
        """One more of this backward's gradients is in (its put follows); True
        when it was the last."""
        self.pending = pending = self.pending - 1
        return pending == 0 and (not self.n_counted or self.counted_in() == self.n_counted)

    def all_in(self) -> bool:
        """Whether every gradient of this backward is in, counted slots included."""
        return self.pending == 0 and self.counted_in() == self.n_counted

    def counted_in(self) -> int:
        """How many counted arrivals this backward heard (one slot heard twice counts twice)."""
        return sum(len(path.arrived) for path in self.counting)

    def counted_params(self) -> list[Any]:
        """The parameters the counted arrivals were heard from, in arrival order."""
        return [p for path in self.counting for p in path.arrived]

    def forget_counted(self) -> None:
        """Drop arrivals heard outside a synchronised backward (no_sync)."""
        for path in self.counting:
            path.arrived.clear()

    def mark_ready(self) -> None:
        """Every gradient is in: launchable once the lower buckets launched."""
        self.state = BucketState.READY

    def launch(self, future: Any) -> None:
        """Its collective (or comm hook) was issued and resolves through ``future``."""
        self.state = BucketState.LAUNCHED
        self.future = future

    def complete(self) -> None:
        """The results are written: drop this backward's references to old gradients."""
        self.to_write.clear()
        for path in self.paths:
            path.reset()

    def place(self, ctx: Any, path_classes: Sequence[Any]) -> None:
        """Decide every slot's kind (see [Note: slot kinds]): the fast paths in
        ``path_classes`` (in order) that are offered this bucket under ``ctx``
        claim slots, the core takes the rest; make the paths' objects."""
        offered = [c for c in path_classes if c.offered(self, ctx)]
        for s in range(len(self.params)):
            if ctx.view_mode:
                self.kinds[s] = SlotKind.VIEW
                continue
            self.kinds[s] = next((c.kind for c in offered if c.claims(self, s)), SlotKind.COPIED)
        taken = set(self.kinds)
        self.paths = tuple(c(self, ctx) for c in offered if c.kind in taken)
        was = self.n_counted
        self.counting = tuple(p for p in self.paths if getattr(p, "counted", ()))
        self.n_counted = sum(len(p.counted) for p in self.counting)
        self.pending += was - self.n_counted
        self.on_full = tuple(p.on_full for p in self.paths if p.on_full is not None)
        self.path_writes = tuple(p.write_back for p in self.paths if p.write_back is not None)

    def path_of(self, s: int) -> Any:
        """The fast path that holds slot ``s``, or None (the core)."""
        kind = self.kinds[s]
        return next((p for p in self.paths if p.kind is kind), None)

    def _make_buffer(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The flat buffer the collective reduces, and per-slot views shaped like
        the parameters (with gradient_as_bucket_view, what param.grad becomes)."""
        p0 = self.params[0]
        buffer = self._allocate(sum(self.numels), p0.dtype, p0.device)
        views = [slot_view(buffer, off, p) for off, p in zip(self.offsets, self.params)]
        return buffer, views

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Back to FILLING, for the next backward."""
        self.pending = self.size - self.n_counted
        self.state = BucketState.FILLING
        self.future = None
        self.to_write.clear()
        for path in self.paths:
            path.reset()


# [Note: the gradient layout contract]
# torch's autograd gives a dense, non-overlapping parameter a gradient with
# the parameter's own strides (a channels_last convolution's weight, a
# parameter made from a transposed tensor), and torch's reducer lays each
# bucket slot out the same way; any other parameter gets row-major strides.
# Optimizers that pair parameter and gradient elements by memory position
# (the fused and foreach AdamW and SGD) depend on it. So a slot view is the
# parameter's layout over the slot's elements: what ``.grad`` becomes in
# view mode, what packed copies go through, and what
# a ``.grad`` made by cloning a slot inherits. A slot's memory order is
# therefore the parameter's memory order, and a path that moves a gradient
# as flat memory (homing) may only do so for a gradient of the same strides.


def layout_strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides a gradient of ``t`` gets under the layout contract: ``t``'s
    own when it is dense and non-overlapping, row-major otherwise."""
    shape, strides = t.shape, t.stride()
    dims = sorted((d for d in range(t.dim()) if shape[d] != 1), key=lambda d: strides[d])
    expected = 1
    for d in dims:
        if strides[d] != expected:
            return _row_major(shape)
        expected *= shape[d]
    return tuple(strides) if t.numel() > 0 else _row_major(shape)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def slot_view(buffer: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """The slot of ``param`` at element ``offset`` of the flat ``buffer``,
    shaped and strided as its gradient is (see [Note: the gradient layout contract])."""
    span = buffer.narrow(0, offset, param.numel())
    return span.as_strided(param.shape, layout_strides(param))
