"""The fast path ``homed``: a gradient stays in ``.grad`` and the collective
reads and writes it there (see [Note: the core and its fast paths] in
``gradring/fast_paths.py`` and [Note: external parts] in ``comm/external.py``)."""

from __future__ import annotations

from typing import Any

import torch

from gradring.buckets.bucket import Bucket, SlotKind
from gradring.buckets.packing import scale_tensor
from gradring.buckets.slot_io import SlotContext, put_copied


class HomedPath:
    """One bucket's homed slots: this backward's gradients left in ``.grad``."""

    kind = SlotKind.HOMED

    def __init__(self, bucket: Bucket, ctx: SlotContext) -> None:
        # The part of the buffer this rank reduces itself (comm.own_range).
        self.own = ctx.own
        # This backward's homed gradients: (offset, flat .grad) pairs.
        self.homes: list[tuple[int, torch.Tensor]] = []

    @staticmethod
    def offered(bucket: Bucket, ctx: SlotContext) -> bool:
        """Whether the bucket may be homed: CPU, floating point, world > 1, not
        view mode, no comm hook, no second reducer on these parameters."""
        return (ctx.world_size > 1 and not ctx.view_mode and not ctx.hooked and not ctx.shared
                and bucket.buffer.dtype.is_floating_point and bucket.buffer.device.type == "cpu")

    @staticmethod
    def claims(bucket: Bucket, s: int) -> bool:
        """Homing moves row-major memory: only contiguous parameters."""
        return bucket.params[s].is_contiguous()

    def put(self, bucket: Bucket, s: int, scale: float) -> None:
        """Copy in (scaled) only what the peers read, the part outside this rank's
        own chunk; the collective reads the rest from ``.grad`` and writes the
        whole result back into it."""
        grad = bucket.params[s].grad
        view = bucket.views[s]
        # A gradient that requires grad (backward(create_graph=True)) is
        # copied: the collective's thread would record autograd history on it.
        # No gradient, or a sparse one, is copied too. Homing moves the gradient
        # as flat memory: only where the gradient and its slot are both row-major
        # ([Note: the gradient layout contract] in bucket.py).
        if not (grad is not None and grad.layout is torch.strided and grad.is_contiguous()
                and view.is_contiguous()
                and not grad.requires_grad
                and grad.dtype == view.dtype and grad.device == view.device
                and grad.numel() == view.numel()):
            put_copied(bucket, s, scale)
            return
        flat = grad.view(-1)
        start, n = bucket.offsets[s], bucket.numels[s]
        lo, hi = self.own
        for a, b in ((start, min(start + n, lo)), (max(start, hi), start + n)):
            if a < b:
                torch.mul(flat[a - start:b - start], scale_tensor(scale, flat.dtype),
                          out=bucket.buffer[a:b])
        self.homes.append((start, flat))

    #: Nothing to do when the bucket is full, nor at the write-back: the
    #: collective wrote the result into ``.grad``.
    on_full = None
    write_back = None

    def reduce(self, comm: Any, bucket: Bucket, scale: float, label: str) -> Any:
        """The homed all-reduce when some gradient stayed in ``.grad`` (a future),
        else None (the core's)."""
        if not self.homes:
            return None
        pieces = sorted(self.homes, key=_offset)
        return comm.all_reduce_homed(bucket.buffer, pieces, scale, label=label, async_op=True)

    def reset(self) -> None:
        """Drop this backward's references to the gradients."""
        self.homes.clear()


def _offset(piece: tuple[int, torch.Tensor]) -> int:
    return piece[0]
