"""One byte buffer that a list of tensors of mixed dtypes is broadcast through.

A coalesced broadcast (``GroupComm.broadcast_coalesced``) sends tensors of
every dtype as one collective over one byte buffer, each dtype's part at an
offset aligned to ``ALIGN``. :func:`byte_layout` says where each part goes;
:class:`ByteStage` keeps such a buffer, and the flat views into it, for a
list of tensors broadcast again and again: the per-forward buffer sync (see
[Note: buffer sync per forward] in ``gradring/ddp/buffers.py``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch

#: Byte alignment of each dtype's part of a coalesced broadcast.
ALIGN = 16


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def byte_layout(groups: Sequence[tuple[torch.dtype, Sequence[torch.Tensor]]],
                ) -> tuple[list[tuple[torch.dtype, Sequence[torch.Tensor], int, int]], int]:
    """Where each dtype's tensors go in one byte buffer: (dtype, tensors, byte
    offset aligned to ALIGN, byte size) per group, and the total size."""
    layout, total = [], 0
    for dtype, group in groups:
        total = -(-total // ALIGN) * ALIGN
        nbytes = sum(t.numel() for t in group) * _itemsize(dtype)
        layout.append((dtype, group, total, nbytes))
        total += nbytes
    return layout, total


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    """Whether two sequences hold the same objects (by identity), in order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


class ByteStage:
    """One persistent byte buffer that a fixed list of CPU tensors is broadcast
    through, each at a fixed offset (see [Note: buffer sync per forward])."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 allocate: Callable[[int], torch.Tensor]) -> None:
        # The tensors in the caller's order, and the memory they were over.
        self.tensors = list(tensors)
        self._ptrs = [t.data_ptr() for t in self.tensors]
        self._shapes = [t.shape for t in self.tensors]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in self.tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        layout, total = byte_layout(list(by_dtype.items()))
        # The byte buffer itself (allocate may place it in shared memory).
        self.buffer = allocate(total)
        # Per dtype: the tensors' flat views, their part of the buffer, and
        # that part split into the tensors' pieces.
        self._parts: list[tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]] = []
        for dtype, group, off, nbytes in layout:
            part = self.buffer.narrow(0, off, nbytes).view(dtype)
            pieces = list(part.split([t.numel() for t in group]))
            self._parts.append(([t.view(-1) for t in group], part, pieces))

    @staticmethod
    def fits(tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every tensor can be viewed flat (contiguous, not sparse)."""
        return all(t.layout is torch.strided and t.is_contiguous() for t in tensors)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are this stage's tensors, over the same memory."""
        return (same_objects(tensors, self.tensors)
                and [t.data_ptr() for t in tensors] == self._ptrs
                and [t.shape for t in tensors] == self._shapes)

    def pack(self) -> None:
        for flats, part, _ in self._parts:
            torch.cat(flats, out=part)

    def unpack(self) -> None:
        for flats, _, pieces in self._parts:
            torch._foreach_copy_(flats, pieces)
