"""Lent gradients: ``.grad`` in bucket memory (outside a rank's own chunk, or small).

[Note: lent gradients]
Without ``gradient_as_bucket_view`` a homed bucket (see [Note: homed
all-reduce] in ``comm/homes.py``) keeps its gradients in their own ``.grad``
tensors. For the own chunk that costs nothing: this rank reduces it in place.
But every other chunk is reduced by a peer, which writes the result into this
rank's shared bucket, and a private ``.grad`` then needs one more copy out of
the bucket.

So a parameter whose slot lies wholly outside the own chunk is *lent* its
bucket slot: the (scaled) gradient is copied into the slot, as always, by
its hook or, for a slot that is not too large, when the bucket is ready
(see [Note: held slots] in ``bucket.py``), and ``.grad`` is set to a view
of the slot. The peer's result lands in
``.grad`` with no copy at all. Small slots are never lent: they are packed
(see [Note: packed slots] in ``packing.py``), copied in and out a run at a
time, which costs less than lending each one.

What a user can observe, and how it stays what torch's DDP gives:

- Values, shapes, dtype, strides and ``requires_grad`` are the same; ``.grad``
  is a view (``._base`` is the bucket), as with ``gradient_as_bucket_view``.
- ``zero_grad(set_to_none=False)`` and ``no_sync()`` accumulate in place into
  the lent view, which is what torch's non-view mode does with an existing
  ``.grad`` (and its copy-out also writes into it in place).
- With ``set_to_none=True`` torch hands out a *new* tensor every iteration; a
  reference kept to an old ``.grad`` keeps its values. Lending reuses the
  slot, so before the first write of a backward into a bucket, :func:`claim`
  counts the references to the bucket's storage. Expected are the reducer's
  own (buffer and slot views) and the lent views that are still some
  parameter's ``.grad``. Any other one (an old ``.grad`` kept, or a view
  of it) moves the bucket to a fresh buffer and leaves the old memory to
  whoever holds it: copy on write, at the price of one allocation.

Lent slots are decided per bucket at install, for homable buckets only (CPU,
floating point, world > 1, not view mode), and used while no comm hook is set:
the bucket stores ``SlotKind.LENT`` for them (see [Note: slot kinds] in
``bucket.py``).
"""

from __future__ import annotations

import sys
import weakref
from typing import Protocol

import torch

from gradring.buckets.packing import SMALL_SLOT_NUMEL, scale_tensor


class LendingBucket(Protocol):
    """What lending reads of its bucket (:class:`~gradring.buckets.bucket.Bucket`),
    and the one thing it asks of it: a fresh buffer."""

    buffer: torch.Tensor
    views: list[torch.Tensor]
    params: list[torch.Tensor]
    offsets: list[int]
    numels: list[int]
    own: tuple[int, int]
    homable: bool

    def reallocate(self) -> None: ...


_use_count = getattr(torch._C, "_storage_Use_Count", None)

#: Lending needs to count storage references; torch builds without it never lend.
SUPPORTED = _use_count is not None


def storage_refs(t: torch.Tensor) -> int:
    """References to ``t``'s storage (a constant +1 for the temporary handle)."""
    assert _use_count is not None
    return int(_use_count(t.untyped_storage()._cdata))


def _probe_fresh() -> tuple[tuple[int, int], tuple[int, int]]:
    """Python and storage references of a gradient autograd has just stored, as
    :func:`fresh` sees them through one call: from its own parameter's
    post-accumulate hook, and from a later parameter's hook (where a bucket's
    held slots are put in, see [Note: held slots] in ``bucket.py``)."""
    own: list[tuple[int, int]] = []
    later: list[tuple[int, int]] = []
    first: list[torch.Tensor] = []

    def through_one_call(grad: torch.Tensor) -> tuple[int, int]:
        # Counted exactly as fresh() counts: the caller's local, one parameter.
        return sys.getrefcount(grad), storage_refs(grad)

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        own.append(through_one_call(grad))
        del grad
        if first:
            grad = first[0].grad
            assert grad is not None
            later.append(through_one_call(grad))
        else:
            first.append(param)
    # The first rebuilt buckets may be installed inside a forward run under
    # no_grad or inference_mode: the probe needs ordinary autograd.
    with torch.inference_mode(False), torch.enable_grad():
        a = torch.zeros(2, requires_grad=True)
        b = torch.zeros(3, requires_grad=True)
        handles = [t.register_post_accumulate_grad_hook(hook) for t in (a, b)]
        try:
            (a.sum() + b.sum()).backward()
        finally:
            for h in handles:
                h.remove()
    return own[0], later[0]


_FRESH: tuple[tuple[int, int], tuple[int, int]] | None = None


def fresh(grad: torch.Tensor, later: bool = False) -> bool:
    """Whether nobody but its parameter and the caller's one local reference
    holds ``grad``, so that replacing it with a lent view is unobservable.
    (Otherwise torch's DDP would write the result into that very tensor.)
    ``later``: seen from a later parameter's hook, not from its own."""
    probed = _FRESH
    assert probed is not None, "install() probes first"
    expected = probed[1] if later else probed[0]
    # Counted as the probe counts (one call, no helper frames: this runs per gradient).
    if sys.getrefcount(grad) > expected[0]:
        return False
    return _use_count(grad.untyped_storage()._cdata) <= expected[1]  # type: ignore[misc]


def lendable_slots(bucket: LendingBucket) -> frozenset[int]:
    """Slots of contiguous parameters wholly outside the bucket's own chunk,
    except small ones (those are packed, see packing.SMALL_SLOT_NUMEL)."""
    if not (SUPPORTED and bucket.homable):
        return frozenset()
    lo, hi = bucket.own
    return frozenset(
        s for s, (off, n, p) in enumerate(zip(bucket.offsets, bucket.numels, bucket.params))
        if (off + n <= lo or off >= hi) and n > SMALL_SLOT_NUMEL and p.is_contiguous())


class LentSlots:
    """A bucket's lending state: which slots may be lent, and the views handed out.

    Owned by its :class:`~gradring.buckets.bucket.Bucket`; the puts ask it to
    lend, hand out and claim, and never touch its fields.
    """

    __slots__ = ("bucket", "slots", "handed", "base_refs", "ever", "_recycled")

    def __init__(self, bucket: LendingBucket) -> None:
        # The bucket whose memory is lent (its buffer may be replaced by claim()).
        self.bucket = bucket
        # Slots whose parameter may hold its .grad in bucket memory.
        self.slots: frozenset[int] = frozenset()
        # slot -> weak reference to the view last handed out as .grad.
        self.handed: dict[int, weakref.ref] = {}
        # Storage references the bucket itself holds (buffer and slot views).
        self.base_refs = 0
        # Whether any view was ever handed out (claim() has nothing to do before).
        self.ever = False
        # [Note: recycled gradients]
        # Per lent slot, the private gradient its parameter last gave up for the
        # lent view, freed only when the next one replaces it. Freeing each in
        # the middle of backward let glibc hand heap pages back to the kernel and
        # fault them in again: 2-4 thousand page faults per step were measured.
        # Memory stays what torch's non-view mode uses (one .grad-sized tensor
        # plus the bucket per parameter). Kept across reset_memory(): a new
        # buffer does not change what the parameters gave up.
        self._recycled: dict[int, torch.Tensor] = {}
        self.reset_memory()

    def reset_memory(self) -> None:
        """Start over on the bucket's current buffer (new or re-allocated)."""
        global _FRESH
        bucket = self.bucket
        self.slots = lendable_slots(bucket)
        if self.slots and _FRESH is None:
            _FRESH = _probe_fresh()
        self.handed = {}
        self.base_refs = storage_refs(bucket.buffer) if self.slots else 0

    def lend(self, slot: int, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """Copy ``grad`` (scaled) into ``slot`` and return the view to become
        ``.grad``; ``grad`` is kept for reuse (see [Note: recycled gradients])."""
        view = self.hand_out(slot)
        torch.mul(grad, scale_tensor(scale, grad.dtype), out=view)
        self._recycled[slot] = grad
        return view

    def recycled_bytes(self) -> int:
        """Bytes of the given-up gradients kept for reuse (see [Note: recycled gradients])."""
        return sum(t.numel() * t.element_size() for t in self._recycled.values())

    def hand_out(self, slot: int) -> torch.Tensor:
        """A fresh view of ``slot`` to become ``.grad`` (fresh, so that a kept one is seen)."""
        slot_view = self.bucket.views[slot]
        # A new view of the bucket's own slot view (view_as parses its argument
        # faster than view(shape): 1.4 us against 4.2 measured).
        view = slot_view.view_as(slot_view)
        self.handed[slot] = weakref.ref(view)
        self.ever = True
        return view

    def in_use(self, slot: int) -> bool:
        """Whether ``slot``'s parameter holds, as ``.grad``, the view lent to it."""
        ref = self.handed.get(slot)
        view = ref() if ref is not None else None
        return view is not None and view is self.bucket.params[slot].grad

    def any_in_use(self) -> bool:
        return any(self.in_use(s) for s in self.handed)

    def claim(self) -> bool:
        """Before a backward's first write into the bucket: if anybody but its
        parameters' ``.grad`` still holds lent memory, move the bucket to a fresh
        buffer (copying the ``.grad`` still lent, and pointing it at the new
        slots). Returns True if it moved."""
        if not self.ever:
            return False
        bucket = self.bucket
        attached = [s for s in self.handed if self.in_use(s)]
        if storage_refs(bucket.buffer) == self.base_refs + len(attached):
            return False
        old = [(s, bucket.params[s].grad) for s in attached]
        bucket.reallocate()
        self.reset_memory()
        with torch.no_grad():
            for s, grad in old:
                view = self.hand_out(s)
                view.copy_(grad)
                bucket.params[s].grad = view
        return True
