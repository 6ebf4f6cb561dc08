"""The bucket object a communication hook sees (the same surface as torch's GradBucket)."""

from __future__ import annotations

import torch

from gradring.buckets.bucket import Bucket, slot_view


class GradBucket:
    """What ``hook(state, bucket)`` receives: one flat buffer and the views into it.

    ``buffer()`` holds this rank's gradients, *not* divided by the world size:
    dividing is the hook's job, exactly as with torch's GradBucket.
    """

    __slots__ = ("_bucket", "_last", "_buffer")

    def __init__(self, bucket: Bucket, *, is_last: bool) -> None:
        self._bucket = bucket
        self._last = is_last
        # What buffer() returns: the bucket's flat buffer until a hook replaces it.
        self._buffer = bucket.buffer

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        b = self._bucket
        if self._buffer is b.buffer:
            return list(b.views)
        # After set_buffer (torch's fp16/bf16 wrappers), views of the current buffer.
        return [slot_view(self._buffer, off, p) for off, p in zip(b.offsets, b.params)]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Make ``buffer()`` return ``tensor`` for the rest of this hook call (e.g. an
        fp16 copy). The reducer copies whatever the hook's future returns back into
        the bucket's own buffer, converting the dtype."""
        self._buffer = tensor
