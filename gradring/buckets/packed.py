"""The fast path ``packed``: a bucket's small slots copied in and out at once
(see [Note: packed slots] in ``packing.py``)."""

from __future__ import annotations

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
