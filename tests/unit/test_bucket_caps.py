"""BucketCaps.parse, every form of bucket_cap_mb, against what torch's DDP
constructor does with the same value: ``int(bucket_cap_mb * 1024 * 1024)``,
then its bucket assignment (``_compute_bucket_assignment_by_size``), at once
with find_unused_parameters and at the rebuild otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradring.buckets import MIB, BucketCaps, assign_buckets
from gradring.buckets.assign import DEFAULT_FIRST_BUCKET_BYTES

TENSORS = [torch.empty(n) for n in (10, 300, 5, 70000, 2, 300000)]
SIZES = [t.numel() * t.element_size() for t in TENSORS]


def _torch(cap_mb: object, *, find_unused: bool) -> list[list[int]] | type[BaseException]:
    """torch's buckets for ``cap_mb`` (rebuild caps: [cap] for an explicit cap),
    or the type of the error its constructor raises."""
    try:
        cap = int(cap_mb * MIB)  # type: ignore[operator]
        caps = [DEFAULT_FIRST_BUCKET_BYTES, cap] if find_unused else [cap]
        if find_unused:
            dist._compute_bucket_assignment_by_size(TENSORS, caps)  # at construction
        # At the rebuild torch's C++ reducer holds the cap as an unsigned size:
        # a negative one is larger than any model (tests/ranks/test_ddp_buckets.py
        # checks that against torch's DDP itself).
        return dist._compute_bucket_assignment_by_size(TENSORS, [cap if cap >= 0 else 1 << 62])[0]
    except (TypeError, ValueError, OverflowError) as exc:
        return type(exc)


def _ours(cap_mb: object, *, find_unused: bool) -> list[list[int]] | type[BaseException]:
    try:
        caps = BucketCaps.parse(cap_mb)
        caps.initial(find_unused=find_unused)
        return assign_buckets(SIZES, caps.rebuild())
    except (TypeError, ValueError) as exc:
        return type(exc)


@pytest.mark.parametrize("find_unused", [False, True])
@pytest.mark.parametrize("cap_mb", [25, 2.5, 0.001, 1e-7, 0, -1e-7, -1, -25.0])
def test_numbers_bucket_as_torch(cap_mb, find_unused):
    want = _torch(cap_mb, find_unused=find_unused)
    got = _ours(cap_mb, find_unused=find_unused)
    if isinstance(want, type):
        assert got is TypeError and want is TypeError, (got, want)
    else:
        assert got == [sorted(b) for b in want], (got, want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "big", True, [1]])
def test_what_torch_cannot_convert_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a finite number or 'auto'"):
        BucketCaps.parse(bad)


def test_auto_and_the_list():
    auto = BucketCaps.parse(" Auto ")
    assert auto.auto and auto.cap == 25 * MIB and auto.first == DEFAULT_FIRST_BUCKET_BYTES
    chosen = auto.chosen(8 * MIB, None)
    assert not chosen.auto and chosen.rebuild() == [DEFAULT_FIRST_BUCKET_BYTES, 8 * MIB]
    assert auto.chosen(MIB // 2, 4 * MIB).rebuild() == [MIB // 2]
    listed = BucketCaps.parse("auto", [1, 4])  # the list wins over "auto", as before
    assert not listed.auto and listed.rebuild() == [MIB, 4 * MIB] and listed.cap == 4 * MIB
