"""Gradient buckets: the pure assignment function and the flat-buffer Bucket.

[Note: bucket assignment]
Parameters are packed into buckets by walking them in a given order and
sealing the open bucket of a (dtype, device) key once its byte size *reaches*
the current cap, so a bucket may overshoot the cap by one tensor. Each key
walks its own list of caps; the last cap repeats. The result is ordered by
where each bucket's first tensor sits in the walk. DDP calls this twice:

- at construction, over definition order, and then reverses the list so the
  last-defined layers (whose gradients arrive first) land in bucket 0;
- at the rebuild, over the order in which gradients actually arrived during a
  backward, with caps [1 MiB, bucket_cap, ...]; no reversal is needed there.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradring.lending import LentSlots
from gradring.packing import SMALL_SLOT_NUMEL, Run, packed_runs

#: First bucket's cap after a rebuild: small, so the first all-reduce starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
#: HOMED and LENT slots of at most this many elements (1 MiB of fp32) are held
#: until their bucket is ready (see [Note: held slots]); larger ones are put
#: in by their hook.
HELD_SLOT_NUMEL = 262144
#: bucket_cap_mb's default.
DEFAULT_BUCKET_CAP_MB = 25
MIB = 1024 * 1024


def assign_buckets(
    sizes: Sequence[int],
    caps: Sequence[int],
    *,
    keys: Sequence[Hashable] | None = None,
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group tensor indices into buckets by byte size (see [Note: bucket assignment]).

    ``sizes[i]`` is tensor i's size in bytes, ``keys[i]`` its (dtype, device)
    key (tensors with different keys never share a bucket), ``order`` the walk
    order (default: index order). ``caps`` must be non-empty; the last repeats.

    >>> assign_buckets([400, 800, 400, 200], [400])
    [[0], [1], [2], [3]]
    """
    if not caps:
        raise ValueError("assign_buckets needs at least one cap")
    if any(c <= 0 for c in caps):
        raise ValueError(f"bucket caps must be positive, got {list(caps)}")
    n = len(sizes)
    walk = list(range(n)) if order is None else list(order)
    if sorted(walk) != list(range(n)):
        raise ValueError(f"order must be a permutation of range({n}), got {walk}")
    keys = [None] * n if keys is None else list(keys)
    if len(keys) != n:
        raise ValueError(f"got {n} sizes but {len(keys)} keys")

    sealed: list[list[int]] = []
    open_: dict[Hashable, list[int]] = {}
    filled: dict[Hashable, int] = {}
    cap_index: dict[Hashable, int] = {}
    for i in walk:
        k = keys[i]
        open_.setdefault(k, []).append(i)
        filled[k] = filled.get(k, 0) + sizes[i]
        ci = cap_index.get(k, 0)
        if filled[k] >= caps[min(ci, len(caps) - 1)]:
            sealed.append(open_.pop(k))
            filled[k] = 0
            cap_index[k] = ci + 1
    sealed.extend(b for b in open_.values() if b)
    position = {idx: pos for pos, idx in enumerate(walk)}
    sealed.sort(key=lambda b: position[b[0]])
    return sealed


@dataclass(frozen=True)
class BucketCaps:
    """The byte caps DDP's constructor arguments imply, for both assignments.

    As in torch 2.13: ``bucket_cap_mb`` left at None means a 25 MiB cap with a
    1 MiB first bucket (so the first all-reduce starts early); an explicit
    ``bucket_cap_mb`` is also the first bucket's cap; ``bucket_cap_mb_list``
    gives every bucket its own cap (the last repeats), at construction and at
    the rebuild alike.
    """

    cap: int  # bucket_cap_mb in bytes (the largest of bucket_cap_mb_list)
    first: int  # the first bucket's cap after the rebuild
    per_bucket: tuple[int, ...] = ()  # bucket_cap_mb_list in bytes

    @classmethod
    def from_args(cls, bucket_cap_mb: float | None,
                  bucket_cap_mb_list: Sequence[float] | None = None) -> BucketCaps:
        if bucket_cap_mb_list:
            per = tuple(int(mb * MIB) for mb in bucket_cap_mb_list)
            if any(c <= 0 for c in per):
                raise ValueError(f"bucket_cap_mb_list must hold positive sizes, got "
                                 f"{list(bucket_cap_mb_list)}")
            return cls(max(per), max(per), per)
        if bucket_cap_mb is None:
            return cls(DEFAULT_BUCKET_CAP_MB * MIB, DEFAULT_FIRST_BUCKET_BYTES)
        cap = int(bucket_cap_mb * MIB)
        return cls(cap, cap)

    def initial(self, *, find_unused: bool) -> list[int]:
        """Caps of the construction-time assignment (definition order, then reversed)."""
        if self.per_bucket:
            return list(self.per_bucket)
        if not find_unused:
            return [sys.maxsize]  # one bucket until the rebuild has seen a backward
        return [self.first, self.cap] if self.first < self.cap else [self.cap]

    def rebuild(self, cap: int | None = None) -> list[int]:
        """Caps of the rebuild; ``cap`` replaces the cap (bucket_cap_mb="auto")."""
        if self.per_bucket:
            return list(self.per_bucket)
        if cap is not None:
            return [min(DEFAULT_FIRST_BUCKET_BYTES, cap), cap]
        return [self.first, self.cap] if self.first < self.cap else [self.cap]


def bucket_key(t: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    """The key that decides which tensors may share a flat buffer."""
    return (t.dtype, t.device)


class SlotKind(enum.Enum):
    """How one parameter's gradient travels through its bucket slot.

    [Note: slot kinds]
    Decided once per bucket, when it is installed (and again if a comm hook is
    registered), so the per-gradient hook follows a stored decision:

    - ``VIEW``: gradient_as_bucket_view; ``.grad`` *is* the slot.
    - ``HOMED``: the gradient stays in ``.grad``; the collective reads the own
      chunk from it and writes the result back into it ([Note: homed
      all-reduce] in ``comm/homes.py``).
    - ``LENT``: the slot lies outside the own chunk (or is small); the
      gradient is copied in and ``.grad`` becomes a view of the slot ([Note:
      lent gradients] in ``lending.py``).
    - ``COPIED``: copied into the slot and the result copied back out (comm
      hooks, CUDA, integer buckets, one rank).
    - ``PACKED``: a small slot outside view mode; copied in and out like
      ``COPIED``, but a run of neighbours at a time when the bucket is ready
      ([Note: packed slots] in ``packing.py``).

    VIEW and PACKED slots, and HOMED and LENT slots up to HELD_SLOT_NUMEL
    elements, are *deferred*: their hooks only count, and the tensor work is
    done for the whole bucket when its last gradient arrives (see [Note: held
    slots]).

    A gradient that does not fit its slot's kind at run time (no gradient,
    a non-contiguous or sparse one, a kept old ``.grad``) falls back to the
    next simpler kind: LENT -> HOMED -> COPIED, PACKED -> COPIED.
    """

    VIEW = "view"
    HOMED = "homed"
    LENT = "lent"
    COPIED = "copied"
    PACKED = "packed"


# [Note: held slots]
# A HOMED or LENT slot's gradient used to be put in by its own hook. Each
# such hook runs right after a large layer's backward has evicted the
# interpreter's working set from the caches, and every first touch is slow
# there: measured inside a ResNet's hooks, sys.getrefcount took 1.8 us
# (0.07 standalone), a first untyped_storage() 2.8 us (a second one 0.4),
# and a lent put 70-85 us for a 25-35 us copy. So these slots are *held*:
# the hook only counts, the gradient waits in .grad, and when the bucket's
# last gradient arrives every held slot is put in in one burst (then the
# packed slots), in slot order, by the same put methods. The bucket
# launches at the same moment as before; only the puts moved. Reading .grad
# then also sees what later hooks of the same parameter did to it, as
# torch's reducer does. Lending's reference count (lending.fresh) is probed
# for this context too: another parameter's gradient, from a later hook.
#
# Only slots of at most HELD_SLOT_NUMEL elements (1 MiB of fp32) are held.
# A large gradient is best copied while autograd has just written it and it
# is still in cache, and its copy dwarfs the cold start: holding the 4 MiB
# weights of 12 x Linear(1024) made that model's DDP overhead about 4-5 ms
# worse per step. Side by side against putting in at the hook (world 2,
# 30 interleaved steps): ResNet-shaped 0.61 / 0.57 / 0.54 against 0.57 /
# 0.73 / 0.57 of torch's overhead, GPT-shaped (weights of 65-262 K
# elements) 0.34 / 0.25 / 0.28 / 0.23 against 0.43 / 0.35 / 0.46 / 0.32;
# a 64 K limit left the ResNet's larger convolutions at their hooks and
# gained nothing there.


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
        # Gradients still missing in this backward, out of ``size``.
        self.size = len(params)
        self.pending = self.size
        # Lifecycle within one backward.
        self.state = BucketState.FILLING
        # Future of the in-flight collective; resolves to the reduced flat tensor.
        self.future: Any = None
        # Left to be reduced by the finalize on its own thread: the last bucket,
        # or every bucket without overlap (see [Note: the last bucket] in reducer.py).
        self.inline = False
        # The part of the buffer this rank reduces itself (homes.own_range), set by
        # the reducer, and this backward's homed gradients: (offset, flat .grad)
        # pairs and their slots (see [Note: homed all-reduce] in comm/homes.py).
        self.own = (0, 0)
        # Whether gradients may stay in .grad (CPU, floating point, world > 1, not view mode).
        self.homable = False
        self.homes: list[tuple[int, torch.Tensor]] = []
        self.homed_slots: set[int] = set()
        # This backward's slots whose result the reducer copies back into .grad
        # at the end (copied in, or no gradient); the others already hold it.
        self.to_write: list[int] = []
        # Lending state: which slots may hold .grad in this buffer, and the
        # views handed out (see [Note: lent gradients] in lending.py).
        self.lending = LentSlots(self)
        # Per slot, how its gradient travels (see [Note: slot kinds]).
        self.kinds: list[SlotKind] = [SlotKind.COPIED] * len(params)
        # Whether some slots are deferred (VIEW, PACKED or held): the reducer puts
        # them in when the bucket's last gradient arrives.
        self.deferred = False
        # The HOMED and LENT slots, put in when the bucket is ready (see [Note:
        # held slots]).
        self.held: list[int] = []
        # The PACKED slots, as runs of neighbours (see [Note: packed slots]).
        self.runs: tuple[Run, ...] = ()
        # Every packed slot's parameter and view, in slot order, for the
        # bucket-wide copies (see [Note: packed slots]); views follow reallocate().
        self.packed_params: list[torch.Tensor] = []
        self.packed_views: list[torch.Tensor] = []
        # Whether the bucket's packed slots are one run of 1-D slots (a torch.cat).
        self.packed_flat = False
        # This backward's runs (by position in ``runs``) that went slot by slot.
        self.loose: set[int] = set()

    def place(self, own: tuple[int, int], *, homable: bool, view_mode: bool,
              hooked: bool) -> None:
        """Set the own chunk and whether the bucket may be homed, then decide
        every slot's kind (see [Note: slot kinds])."""
        self.own = own
        self.homable = homable
        self.lending.reset_memory()
        self.decide_kinds(view_mode=view_mode, hooked=hooked)

    def decide_kinds(self, *, view_mode: bool, hooked: bool) -> None:
        """Decide each slot's kind: a comm hook sees plain copies, never homes or loans."""
        lent = self.lending.slots
        for s in range(len(self.params)):
            if view_mode:
                kind = SlotKind.VIEW
            elif self.numels[s] <= SMALL_SLOT_NUMEL:
                kind = SlotKind.PACKED
            elif hooked or not self.homable:
                kind = SlotKind.COPIED
            elif s in lent:
                kind = SlotKind.LENT
            else:
                kind = SlotKind.HOMED
            self.kinds[s] = kind
        self.runs = packed_runs([k is SlotKind.PACKED for k in self.kinds], self.offsets,
                                self.numels, self.params, self.param_indices)
        self.held = [s for s, k in enumerate(self.kinds)
                     if (k is SlotKind.HOMED or k is SlotKind.LENT)
                     and self.numels[s] <= HELD_SLOT_NUMEL]
        self.deferred = view_mode or bool(self.runs) or bool(self.held)
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
        views = [buffer.narrow(0, off, n).view(p.shape)
                 for off, n, p in zip(self.offsets, self.numels, self.params)]
        return buffer, views

    def reallocate(self) -> None:
        """Move to a fresh buffer; whoever still holds the old one keeps it."""
        self.buffer, self.views = self._make_buffer()
        self._view_packed()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = self.size
        self.state = BucketState.FILLING
        self.future = None
        self.inline = False
        self.homes = []
        self.homed_slots = set()
        self.to_write = []
        self.loose = set()
