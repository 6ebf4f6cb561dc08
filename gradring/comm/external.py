"""External parts: an all-reduce whose flat buffer has parts that live in other tensors.

[Note: external parts]
A caller may keep some ranges of a flat buffer in tensors of its own, each
holding the input and receiving the result. DDP without
``gradient_as_bucket_view`` is the one user: a gradient stays in its ``.grad``
while the flat bucket is what the peers read, and copying every gradient in
and every result out costs two passes over the bucket, more than the two-shot
itself. A rank's own chunk of a two-shot (``own_range``) is read by nobody
else: this rank reduces it and writes the result into the peers' buffers. So
the caller copies into the flat buffer only the parts of external tensors
outside its own chunk; the own chunk is reduced in place into the external
tensors (:func:`reduce_own`) and written into every peer's buffer, and the
peers' chunks are copied out of this rank's flat buffer into them. Every
other algorithm gets the same result through :func:`stage_in` and
:func:`finish_out` around a plain SUM. ``scale`` weighs this rank's external
inputs (DDP's 1/world size, which the caller applies when it copies the rest
in): each rank scales its own contribution, so ranks may use different
factors (Join) and a 16-bit sum never sees unscaled values.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from gradring.comm import ops


class ExternalParts(NamedTuple):
    """Which ranges of a flat buffer live in other tensors, and how the sum is scaled."""

    #: (offset in the flat buffer, contiguous 1-D tensor), sorted, disjoint.
    pieces: list[tuple[int, torch.Tensor]]
    #: This rank's external inputs count ``scale`` times.
    scale: float = 1.0


def own_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The chunk of a ``numel``-element buffer that ``rank`` reduces itself."""
    return ops.chunk_bounds(numel, world_size)[rank]


def spans(parts: ExternalParts | None, lo: int,
          hi: int) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """Cover ``[lo, hi)`` with ``(a, b, part)``: ``part`` is the tensor holding
    elements ``[a, b)`` (sliced to them), or None where the flat buffer does."""
    if parts is None or not parts.pieces:
        if hi > lo:
            yield lo, hi, None
        return
    pieces = parts.pieces
    i = max(0, bisect.bisect_right(pieces, lo, key=lambda piece: piece[0]) - 1)
    pos = lo
    while pos < hi:
        if i < len(pieces):
            start, t = pieces[i]
            end = start + t.numel()
            if end <= pos:
                i += 1
                continue
            if start > pos:  # a gap before the next part
                b = min(start, hi)
                yield pos, b, None
                pos = b
                continue
            b = min(end, hi)
            yield pos, b, t[pos - start:b - start]
            pos = b
            i += 1
        else:
            yield pos, hi, None
            pos = hi


def stage_in(flat: torch.Tensor, parts: ExternalParts, lo: int, hi: int) -> None:
    """Copy the (scaled) external inputs of ``[lo, hi)`` into ``flat`` (generic algorithms)."""
    for a, b, part in spans(parts, lo, hi):
        if part is not None:
            _scaled_copy(flat[a:b], part, parts.scale)


def finish_out(flat: torch.Tensor, parts: ExternalParts) -> None:
    """After a plain SUM of ``flat``: copy every external part out."""
    for start, t in parts.pieces:
        ops.copy(t, flat[start:start + t.numel()])


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    if scale == 1.0:
        ops.copy(dst, src)
    else:
        torch.mul(src, scale, out=dst)


def reduce_own(flat: torch.Tensor, peers: list[torch.Tensor], parts: ExternalParts,
               lo: int, hi: int) -> None:
    """The own chunk ``[lo, hi)`` of a SUM with external parts into those parts (or
    ``flat`` where there is none) and into every peer's buffer in ``peers`` (their
    exposed buffers, in rank order, which hold their inputs for this chunk).

    Sums go in place into the input just read (in cache), then are copied out:
    2-8% faster than summing into a peer's buffer. The sum is the plain two-shot's
    (own input first, then the peers in rank order, each step rounded) after the
    own input is rounded to ``scale`` times itself: the bits of a bucket scaled in
    and summed, the reducer's core, at any world size. Where ``scale`` is a power
    of two the multiply is exact, so it fuses into the first add (one pass fewer).
    """
    scale = parts.scale
    fused = math.frexp(scale)[0] == 0.5  # 1, 1/2, 1/4, ...: exact multiply
    for a, b, part in spans(parts, lo, hi):
        if part is None:
            part = flat[a:b]
            ops.reduce_into(part, [part] + [v[a:b] for v in peers], ops.SUM)
        elif peers and fused:
            torch.add(peers[0][a:b], part, alpha=scale, out=part)
            for v in peers[1:]:
                part.add_(v[a:b])
        else:
            if scale != 1.0:
                part.mul_(scale)
            ops.reduce_into(part, [part] + [v[a:b] for v in peers], ops.SUM)
        for v in peers:
            ops.copy(v[a:b], part)
