"""Pure bucket assignment: no process group needed."""

import sys

import pytest
import torch

from gradring.buckets import DEFAULT_FIRST_BUCKET_BYTES, MIB, assign_buckets


def test_style_example():
    # 100/200/100/50 floats with a 400-byte cap: each reaches the cap alone, the last is left open.
    assert assign_buckets([400, 800, 400, 200], [400]) == [[0], [1], [2], [3]]


def test_seals_once_cap_reached_and_may_overshoot():
    assert assign_buckets([100, 100, 250, 10, 10], [300]) == [[0, 1, 2], [3, 4]]


def test_caps_advance_then_last_repeats():
    sizes = [10] * 7
    assert assign_buckets(sizes, [10, 20]) == [[0], [1, 2], [3, 4], [5, 6]]


def test_keys_never_share_and_caps_are_per_key():
    sizes = [10, 10, 10, 10]
    keys = ["f32", "f16", "f32", "f16"]
    assert assign_buckets(sizes, [20], keys=keys) == [[0, 2], [1, 3]]


def test_order_is_walked_and_result_sorted_by_walk_position():
    sizes = [10, 10, 10, 10]
    assert assign_buckets(sizes, [20], order=[3, 1, 2, 0]) == [[3, 1], [2, 0]]


def _linear12_sizes():
    m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    return [p.numel() * p.element_size() for p in m.parameters()]


def test_reference_numbers_find_unused_layout():
    sizes = _linear12_sizes()
    groups = assign_buckets(sizes, [DEFAULT_FIRST_BUCKET_BYTES, 25 * MIB])
    groups.reverse()
    assert [sum(sizes[i] for i in g) for g in groups] == [16797696, 29388800, 4194304]


def test_reference_numbers_rebuild_layout():
    sizes = _linear12_sizes()
    assert assign_buckets(sizes, [sys.maxsize]) == [list(range(24))]
    arrival = [i for layer in reversed(range(12)) for i in (2 * layer + 1, 2 * layer)]
    groups = assign_buckets(sizes, [DEFAULT_FIRST_BUCKET_BYTES, 25 * MIB], order=arrival)
    assert [sum(sizes[i] for i in g) for g in groups] == [4198400, 29388800, 16793600]
    assert groups[0] == [23, 22]
    assert groups[1] == list(range(21, 7, -1))
    assert groups[2] == list(range(7, -1, -1))


@pytest.mark.parametrize("bad", [[], [0], [-5]])
def test_bad_caps_are_rejected(bad):
    with pytest.raises(ValueError):
        assign_buckets([1, 2], bad)


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets([1, 2], [10], order=[0, 0])


def test_random_invariants():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 30, (1,), generator=g))
        sizes = torch.randint(1, 1000, (n,), generator=g).tolist()
        cap = int(torch.randint(1, 3000, (1,), generator=g))
        order = torch.randperm(n, generator=g).tolist()
        groups = assign_buckets(sizes, [cap], order=order)
        flat = [i for grp in groups for i in grp]
        assert flat == order  # one key: buckets are consecutive runs of the walk
        for grp in groups[:-1]:
            total = sum(sizes[i] for i in grp)
            assert total >= cap and total - sizes[grp[-1]] < cap


