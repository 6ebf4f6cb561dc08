"""The flat-buffer Bucket: its slots, their kinds, and its transitions within one backward."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from gradring.buckets.packing import SMALL_SLOT_NUMEL, Run, packed_runs


class SlotKind(enum.Enum):
    """How one parameter's gradient travels through its bucket slot.

    [Note: slot kinds]
    Decided once per bucket, when it is installed (and again if a comm hook is
    registered), so the per-gradient hook follows a stored decision. The
    core's two kinds (see [Note: the core and its fast paths] in
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
    is done for the whole bucket when its last gradient arrives.

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
        # arrive() counts a gradient in, mark_ready(), launch() or
        # leave_to_finalize(), start_at_finalize() when the finalize reduces it,
        # complete() once its results are written, reset() for the next
        # backward; write_back(), home() and unpack() record how this backward's
        # slots went in. The others read them.
        # Gradients still missing in this backward, out of ``size``.
        self.size = len(params)
        self.pending = self.size
        # Lifecycle within one backward.
        self.state = BucketState.FILLING
        # Future of the in-flight collective; resolves to the reduced flat tensor.
        self.future: Any = None
        # Left to be reduced by the finalize on its own thread (see [Note: buckets
        # left to the finalize] in reducer/launcher.py).
        self.at_finalize = False
        # The part of the buffer this rank reduces itself (comm.own_range), set by
        # the reducer, and this backward's homed gradients: (offset, flat .grad)
        # pairs and their slots (see [Note: external parts] in comm/external.py).
        self.own = (0, 0)
        # Whether gradients may stay in .grad (CPU, floating point, world > 1, not view mode).
        self.homable = False
        self.homes: list[tuple[int, torch.Tensor]] = []
        self.homed_slots: set[int] = set()
        # This backward's slots whose result the reducer copies back into .grad
        # at the end (copied in, or no gradient); the others already hold it.
        # The list is cleared in place, never replaced, so that write_back stays
        # its bound append.
        self.to_write: list[int] = []
        # Records a slot in to_write: the list's own append, so that a put
        # costs no Python call more per gradient (see [Note: the per-gradient
        # path] in reducer/reducer.py).
        self.write_back: Callable[[int], None] = self.to_write.append
        # Per slot, how its gradient travels (see [Note: slot kinds]).
        self.kinds: list[SlotKind] = [SlotKind.COPIED] * len(params)
        # Whether some slots are deferred (PACKED): the reducer puts them in
        # when the bucket's last gradient arrives.
        self.deferred = False
        # The PACKED slots, as runs of neighbours (see [Note: packed slots]).
        self.runs: tuple[Run, ...] = ()
        # Every packed slot's parameter and view, in slot order, for the
        # bucket-wide copies (see [Note: packed slots]); views follow reallocate().
        self.packed_params: list[torch.Tensor] = []
        self.packed_views: list[torch.Tensor] = []
        # Whether the bucket's packed slots are one run of 1-D slots (a torch.cat).
        self.packed_flat = False
        # This backward's runs (by position in ``runs``) that went slot by slot.
        self.unpacked: set[int] = set()

    # ------------------------------------------------- one backward's transitions
    def arrive(self) -> bool:
        """One more of this backward's gradients is in (its put follows); True
        when it was the last."""
        self.pending = pending = self.pending - 1
        return pending == 0

    def mark_ready(self) -> None:
        """Every gradient is in: launchable once the lower buckets launched."""
        self.state = BucketState.READY

    def launch(self, future: Any) -> None:
        """Its collective (or comm hook) was issued and resolves through ``future``."""
        self.state = BucketState.LAUNCHED
        self.future = future

    def leave_to_finalize(self) -> None:
        """Counted as launched, but the finalize reduces it on its own thread
        (see [Note: buckets left to the finalize] in reducer/launcher.py)."""
        self.state = BucketState.LAUNCHED
        self.at_finalize = True

    def start_at_finalize(self) -> None:
        """The finalize (or a drain) now reduces the bucket left to it."""
        self.at_finalize = False

    def home(self, start: int, flat: torch.Tensor, slot: int) -> None:
        """Slot ``slot``'s gradient stays in ``.grad`` (``flat``, at element
        ``start``): the collective reads and writes it there."""
        self.homes.append((start, flat))
        self.homed_slots.add(slot)

    def homed_pieces(self) -> list[tuple[int, torch.Tensor]]:
        """This backward's homed gradients, by offset, for the homed all-reduce."""
        return sorted(self.homes, key=_offset)

    def unpack(self, run: int) -> None:
        """Packed run ``run`` went slot by slot in this backward (so will its write-back)."""
        self.unpacked.add(run)

    def complete(self) -> None:
        """The results are written: drop this backward's references to old gradients."""
        self.homes.clear()
        self.homed_slots.clear()
        self.to_write.clear()

    def place(self, own: tuple[int, int], *, homable: bool, view_mode: bool,
              hooked: bool, pack: bool) -> None:
        """Set the own chunk and whether the bucket may be homed, then decide
        every slot's kind (see [Note: slot kinds])."""
        self.own = own
        self.homable = homable
        self.decide_kinds(view_mode=view_mode, hooked=hooked, pack=pack)

    def decide_kinds(self, *, view_mode: bool, hooked: bool, pack: bool) -> None:
        """Decide each slot's kind: a comm hook sees plain copies, never homes.
        ``pack``: the fast path ``packed`` is on."""
        for s in range(len(self.params)):
            if view_mode:
                kind = SlotKind.VIEW
            elif pack and self.numels[s] <= SMALL_SLOT_NUMEL:
                kind = SlotKind.PACKED
            elif hooked or not self.homable or not self.params[s].is_contiguous():
                kind = SlotKind.COPIED  # homing moves row-major memory
            else:
                kind = SlotKind.HOMED
            self.kinds[s] = kind
        self.runs = packed_runs([k is SlotKind.PACKED for k in self.kinds], self.offsets,
                                self.numels, self.params, self.param_indices)
        self.deferred = bool(self.runs)
        self.packed_params = [p for run in self.runs for p in run.params]
        self.packed_flat = len(self.runs) == 1 and self.runs[0].flat
        self._view_packed()

    def _view_packed(self) -> None:
        self.packed_views = [self.views[s] for run in self.runs for s in range(run.lo, run.hi)]

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
        self.pending = self.size
        self.state = BucketState.FILLING
        self.future = None
        self.at_finalize = False
        self.homes.clear()
        self.homed_slots.clear()
        self.to_write.clear()
        self.unpacked.clear()


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


def _offset(piece: tuple[int, torch.Tensor]) -> int:
    return piece[0]
