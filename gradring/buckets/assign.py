"""Which parameters share a bucket: the pure assignment function, the caps, the keys.

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

import math
import sys
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from gradring import errors

#: First bucket's cap after a rebuild: small, so the first all-reduce starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
#: bucket_cap_mb's default.
DEFAULT_BUCKET_CAP_MB = 25
MIB = 1024 * 1024
#: A cap no bucket reaches: what a negative bucket_cap_mb means (see BucketCaps.parse).
NO_CAP = 1 << 62


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
    """The byte caps DDP's constructor arguments imply, for both assignments
    (held by one owner, ``Rebuild.caps``: [Note: the cap's walk]).

    As in torch 2.13: ``bucket_cap_mb`` left at None means a 25 MiB cap with a
    1 MiB first bucket (so the first all-reduce starts early); an explicit
    ``bucket_cap_mb`` is also the first bucket's cap; ``bucket_cap_mb_list``
    gives every bucket its own cap (the last repeats), at construction and at
    the rebuild alike. ``bucket_cap_mb="auto"`` starts as the default and is
    replaced at the rebuild by the caps it chose (``chosen``).
    """

    cap: int  # bucket_cap_mb in bytes (the largest of bucket_cap_mb_list)
    first: int  # the first bucket's cap after the rebuild
    per_bucket: tuple[int, ...] = ()  # bucket_cap_mb_list in bytes
    auto: bool = False  # bucket_cap_mb="auto": the rebuild picks the cap

    @classmethod
    def parse(cls, bucket_cap_mb: object,
              bucket_cap_mb_list: Sequence[float] | None = None) -> BucketCaps:
        """Every form of the constructor's arguments: None, a number, "auto"
        (any case), or bucket_cap_mb_list (which wins over "auto"). Where
        torch raises (NaN, an infinity, a string other than "auto", a bool
        is taken as a number by torch but never meant as one) a ValueError
        names the value. As torch: a cap under one byte puts every tensor in
        a bucket of its own, and a negative one (which torch's C++ reads as a
        huge unsigned size) puts every tensor of a dtype and device in one
        bucket."""
        auto = is_auto(bucket_cap_mb)
        if auto:
            bucket_cap_mb = None
        if bucket_cap_mb is not None and (
                isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                or not math.isfinite(bucket_cap_mb)):
            raise ValueError(errors.bad_bucket_cap(bucket_cap_mb))
        if bucket_cap_mb is not None and int(bucket_cap_mb * MIB) <= 0:
            cap = 1 if int(bucket_cap_mb * MIB) == 0 else NO_CAP
            return cls(cap, cap)
        caps = cls.from_args(bucket_cap_mb, bucket_cap_mb_list)
        return cls(caps.cap, caps.first, caps.per_bucket, auto=auto and not bucket_cap_mb_list)

    def chosen(self, cap: int, first: int | None) -> BucketCaps:
        """The caps bucket_cap_mb="auto" chose at the rebuild (``first``
        defaults to torch's 1 MiB, and is at most ``cap``)."""
        first = min(DEFAULT_FIRST_BUCKET_BYTES if first is None else first, cap)
        return BucketCaps(cap, first, self.per_bucket)

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
        if self.cap == NO_CAP:
            # torch's DDP assigns these buckets at once, and its assignment takes
            # unsigned sizes: a negative cap is a TypeError there.
            raise TypeError("bucket_cap_mb is negative: with find_unused_parameters=True "
                            "torch's DDP rejects it too (its bucket assignment takes sizes "
                            "of 0 or more); pass a positive bucket_cap_mb")
        return [self.first, self.cap] if self.first < self.cap else [self.cap]

    def rebuild(self) -> list[int]:
        """Caps of the rebuild."""
        if self.per_bucket:
            return list(self.per_bucket)
        return [self.first, self.cap] if self.first < self.cap else [self.cap]


def is_auto(value: object) -> bool:
    """Whether ``bucket_cap_mb`` is "auto" (any case, spaces around allowed)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def bucket_key(t: torch.Tensor) -> tuple[torch.dtype, torch.device]:
    """The key that decides which tensors may share a flat buffer."""
    return (t.dtype, t.device)
