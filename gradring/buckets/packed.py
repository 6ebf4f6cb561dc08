"""The fast path ``packed``: a bucket's small slots copied in and out at once
(see [Note: packed slots] in ``packing.py``), and counted without a Python hook.

[Note: counted slots]
A packed slot's hook does no tensor work, only counts; what is left of its
cost is the interpreter: a Python call from autograd per gradient, about as
much as torch's C++ reducer spends on the whole parameter. So once the
bucket order is final (the rebuild made the buckets in arrival order, the
hooks sit on the tensors, no find_unused_parameters or static_graph, no
compiled autograd), every packed slot but its bucket's last gets a builtin
as its hook: ``arrived.append``, a list's own method, which autograd calls
with the parameter and which runs no Python frame. The bucket's last slot
(the last to arrive in the recorded order) keeps the reducer's hook: when it
fires, the bucket is full if the list holds all the counted slots. So does
the first slot of bucket 0, the backward's first gradient, which marks the
start of the backward for ``overlap_stats()`` and DDP's logging data.

If the arrival order changes, a bucket's last slot can fire before the
counted ones; the bucket is then completed by the next Python hook that
launches buckets (lower buckets are checked before higher ones launch), or
by the check the first hook of the backward queues for its end. A slot heard
twice is found there, and a backward whose counted slots arrived but whose
Python hooks never ran is found at the next forward: the errors torch's
reducer gives, at most one backward later than torch gives them.
"""

from __future__ import annotations

from typing import Any

import torch

from gradring.buckets.bucket import Bucket, SlotKind
from gradring.buckets.packing import (
    SMALL_SLOT_NUMEL,
    copy_in,
    copy_in_all,
    copy_out,
    copy_out_all,
    packed_runs,
)
from gradring.buckets.slot_io import SlotContext, put_copied, write_slot


class PackedPath:
    """One bucket's packed slots, as runs of neighbours."""

    kind = SlotKind.PACKED

    def __init__(self, bucket: Bucket, ctx: SlotContext) -> None:
        kinds = bucket.kinds
        self.runs = packed_runs([k is SlotKind.PACKED for k in kinds], bucket.offsets,
                                bucket.numels, bucket.params, bucket.param_indices)
        # Every packed slot's parameter and view, in slot order, for the
        # bucket-wide copies.
        self.params = [p for run in self.runs for p in run.params]
        self.views = [bucket.views[s] for run in self.runs for s in range(run.lo, run.hi)]
        # Whether the packed slots are one run of 1-D slots (a torch.cat).
        self.flat = len(self.runs) == 1 and self.runs[0].flat
        # This backward's runs (by position in ``runs``) that went slot by slot.
        self.unpacked: set[int] = set()
        # The slots counted by ``arrived.append`` (see [Note: counted slots]):
        # every packed one but the bucket's last, where counting is on.
        self.counted = _counted_slots(bucket, ctx)
        # This backward's counted arrivals: the parameters, as autograd passed them.
        self.arrived: list[torch.Tensor] = []

    def counter(self, s: int) -> Any:
        """Slot ``s``'s hook when it is counted (the list's append), else None."""
        return self.arrived.append if s in self.counted else None

    @staticmethod
    def offered(bucket: Bucket, ctx: SlotContext) -> bool:
        return not ctx.view_mode

    @staticmethod
    def claims(bucket: Bucket, s: int) -> bool:
        return bucket.numels[s] <= SMALL_SLOT_NUMEL

    #: A packed slot's hook only counts it: no put per gradient.
    put = None

    def on_full(self, bucket: Bucket, scale: float) -> None:
        """The bucket's last gradient arrived: put in its packed slots."""
        grad_mode = torch.is_grad_enabled()  # on only under backward(create_graph=True)
        if grad_mode:
            torch._C._set_grad_enabled(False)
        try:
            if not grad_mode and not self.flat and copy_in_all(self.views, self.params, scale):
                return
            buffer, views = bucket.buffer, bucket.views
            for r, run in enumerate(self.runs):
                # create_graph: slot by slot, so that .grad is written with autograd on.
                if grad_mode or not copy_in(buffer, views, run, scale):
                    self.unpacked.add(r)  # its slots go one by one, into to_write
                    for s in range(run.lo, run.hi):
                        put_copied(bucket, s, scale)
        finally:
            if grad_mode:
                torch._C._set_grad_enabled(True)

    def reduce(self, comm: object, bucket: Bucket, scale: float, label: str) -> None:
        return None  # the core's collective

    def write_back(self, bucket: Bucket, used: list[int] | None) -> None:
        """Write the packed runs' results into ``.grad`` (the unpacked ones went
        through the core's write-back)."""
        runs, unpacked, views = self.runs, self.unpacked, bucket.views
        if not unpacked and (used is None or all(
                used[i] for run in runs for i in run.indices)) and \
                copy_out_all(self.params, self.views):
            return
        for r, run in enumerate(runs):
            if r in unpacked:
                continue
            if (used is None or all(used[i] for i in run.indices)) and copy_out(views, run):
                continue
            for slot in range(run.lo, run.hi):
                write_slot(bucket, slot, used)

    def reset(self) -> None:
        self.unpacked.clear()
        self.arrived.clear()


def _counted_slots(bucket: Bucket, ctx: SlotContext) -> frozenset[int]:
    """The packed slots counted without a Python hook: none while counting is off;
    else every packed slot whose hook sits on its tensor, but the last (the last to
    arrive: the rebuild walks the arrival order) and bucket 0's first."""
    countable = ctx.countable
    if countable is None:
        return frozenset()
    last = len(bucket.kinds) - 1
    first = 0 if bucket.index == 0 else -1  # the backward's first gradient: it marks the start
    return frozenset(s for s, kind in enumerate(bucket.kinds)
                     if kind is SlotKind.PACKED and s not in (first, last)
                     and countable[bucket.param_indices[s]])
