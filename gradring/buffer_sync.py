"""The per-forward buffer sync, made cheap when nothing about the buffers changed.

[Note: buffer sync per forward]
With ``broadcast_buffers=True`` every forward broadcasts rank 0's module
buffers (BatchNorm's running statistics and batch counters). torch's DDP
walks ``named_buffers()`` again before each broadcast, so that a buffer the
model reassigned is the one sent, and then flattens the buffers into a new
tensor per dtype and splits the result back out.

For a ResNet-shaped model (60 buffers over 62 modules) that Python cost more
than the broadcast itself: 0.35 ms to walk, 0.4 ms to flatten and split,
per forward. Two objects here keep what the last forward built and only
check that it still holds:

- :class:`BufferWalk` remembers the module tree and its buffers. A forward
  compares, by identity, each module's children and each module's buffers
  with what it saw last time (two list comprehensions); only if anything
  differs (a buffer reassigned, registered or removed, a submodule added or
  replaced) does it walk ``named_buffers()`` again.
- :class:`ByteStage` keeps one byte buffer, in shared memory on one host,
  laid out with every buffer's bytes at a fixed, dtype-aligned offset, and
  the flat views that copy them in and out. The source rank packs with one
  ``torch.cat`` per dtype, the others unpack with one
  ``torch._foreach_copy_`` per dtype. The stage is reused while the tensors
  are the same objects over the same memory (identity, data pointer and
  shape are compared); otherwise it is laid out again.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import torch
from torch import nn

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


def _same(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


class BufferWalk:
    """``root.named_buffers()`` minus ignored names, walked again only when the
    module tree or its buffers changed (see [Note: buffer sync per forward])."""

    def __init__(self, root: nn.Module, ignore: set[str]) -> None:
        self.root = root
        self.ignore = ignore
        # The tree as last seen: modules in pre-order, every module's children,
        # every module's buffer slots (None included), all by identity.
        self._modules: list[nn.Module] = []
        self._children: list[nn.Module | None] = []
        self._slots: list[torch.Tensor | None] = []
        # What named_buffers() gave then.
        self.named: dict[str, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []

    def read(self) -> bool:
        """Bring ``buffers`` and ``named`` up to date; True if they changed."""
        mods = self._modules
        if mods:
            children = [c for m in mods for c in m._modules.values()]
            slots = [b for m in mods for b in m._buffers.values()]
            if _same(children, self._children) and _same(slots, self._slots):
                return False
        self._modules = [m for _, m in self.root.named_modules()]
        self._children = [c for m in self._modules for c in m._modules.values()]
        self._slots = [b for m in self._modules for b in m._buffers.values()]
        named = [(n, b) for n, b in self.root.named_buffers() if n not in self.ignore]
        changed = not _same([b for _, b in named], self.buffers)
        self.named = dict(named)
        self.buffers = [b for _, b in named]
        return changed


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
        return (_same(tensors, self.tensors)
                and [t.data_ptr() for t in tensors] == self._ptrs
                and [t.shape for t in tensors] == self._shapes)

    def pack(self) -> None:
        for flats, part, _ in self._parts:
            torch.cat(flats, out=part)

    def unpack(self) -> None:
        for flats, _, pieces in self._parts:
            torch._foreach_copy_(flats, pieces)
