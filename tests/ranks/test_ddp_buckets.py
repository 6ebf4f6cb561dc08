"""Buckets: torch's sizes before and after the rebuild, bucket caps against torch's
(ranks with different caps follow rank 0), and gradient_as_bucket_view."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradring
from tests.support.side_by_side import IMPLS, _flat_params, _same_everywhere


def _linear12():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _reference_buckets(rank, world_size, find_unused):
    ddp = gradring.DistributedDataParallel(_linear12(), find_unused_parameters=find_unused)
    seen = []
    x = torch.randn(2, 1024)
    for _ in range(3):
        ddp(x).sum().backward()
        data = ddp._get_ddp_logging_data()
        # torch's logging data gives sizes as "n1, n2" and the rebuilt indices
        # flat; the reducer keeps each bucket's.
        seen.append((_ints(data["bucket_sizes"]), _ints(data["rebuilt_bucket_sizes"]),
                     ddp.reducer.rebuilt_param_indices, data["has_rebuilt_buckets"]))
    return seen


def test_reference_bucket_numbers_default_mode(pools):
    seen = pools.run(2, _reference_buckets, False)[0]
    (sizes1, rebuilt1, _, has1), (sizes2, rebuilt2, idx2, has2), _ = seen
    assert sizes1 == [50380800] and rebuilt1 == [] and not has1
    # After the 2nd forward (seen after its backward): rebuilt in arrival order.
    assert has2 and rebuilt2 == [4198400, 29388800, 16793600]
    assert idx2 == [[23, 22], list(range(21, 7, -1)), list(range(7, -1, -1))]


def test_reference_bucket_numbers_find_unused(pools):
    seen = pools.run(2, _reference_buckets, True)[0]
    for sizes, rebuilt, _, has in seen:
        assert sizes == [16797696, 29388800, 4194304]
        assert rebuilt == [] and not has


def _six_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])


def _sizes(value) -> list[int]:
    """torch's logging data gives sizes as '1, 2'; gradring's as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [int(v) for v in value.split(",") if v.strip()]
    return [int(v) for v in value]


def _bucket_sizes(rank, world_size, kwargs, torch_kwargs=None):
    out = {}
    for name, cls in IMPLS.items():
        kw = kwargs if name == "gradring" or torch_kwargs is None else torch_kwargs
        ddp = cls(_six_linears(), **kw)
        x = torch.randn(2, 1024)
        for _ in range(3):
            ddp(x).sum().backward()
        data = ddp._get_ddp_logging_data()
        out[name] = (_sizes(data["bucket_sizes"]), _sizes(data.get("rebuilt_bucket_sizes")),
                     _same_everywhere(_flat_params(ddp.module) - 0)
                     and _same_everywhere(torch.cat([p.grad.reshape(-1)
                                                     for p in ddp.module.parameters()])))
    return out


@pytest.mark.parametrize("kwargs", [
    {}, {"bucket_cap_mb": 5}, {"bucket_cap_mb": 25}, {"bucket_cap_mb": 0.5},
    {"find_unused_parameters": True}, {"find_unused_parameters": True, "bucket_cap_mb": 5},
    {"bucket_cap_mb": 0}, {"bucket_cap_mb": -1},
], ids=["default", "5", "25", "0.5", "find_unused", "find_unused_5", "0", "-1"])
def test_bucket_caps_match_torch(pools, kwargs):
    for r in pools.run(2, _bucket_sizes, kwargs):
        assert r["gradring"] == r["torch"]
        assert r["gradring"][2]  # replicas agree
    if kwargs == {"bucket_cap_mb": 5}:
        # An explicit cap is also the first rebuilt bucket's: three of two layers.
        assert r["gradring"][1] == [8396800] * 3


def _different_caps(rank, world_size, find_unused):
    kwargs = {"bucket_cap_mb": [3, 7, 5][rank % 3], "find_unused_parameters": find_unused}
    if not find_unused:
        return _bucket_sizes(rank, world_size, kwargs)
    # torch's DDP cannot train here (its first buckets differ across ranks and
    # gloo aborts); the oracle is torch with rank 0's cap on every rank.
    return _bucket_sizes(rank, world_size, kwargs, {**kwargs, "bucket_cap_mb": 3})


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_with_different_caps_follow_rank0(pools, world_size, find_unused):
    results = pools.run(world_size, _different_caps, find_unused)
    for r in results:
        assert r["gradring"] == r["torch"]
        assert r["gradring"][2]
    assert all(r["gradring"][:2] == results[0]["gradring"][:2] for r in results)


def _bucket_view(rank, world_size):
    ddp = gradring.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)),
                                           gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    buffers = [b.buffer for b in ddp.reducer.buckets]

    def inside(t):
        return any(b.data_ptr() <= t.data_ptr() < b.data_ptr() + b.numel() * b.element_size()
                   for b in buffers)
    all_views = all(inside(p.grad) for p in ddp.module.parameters())
    try:
        ddp.module[0].weight.grad.detach_()
        detach_msg = "no error"
    except RuntimeError as e:
        detach_msg = str(e)
    return all_views, detach_msg


def test_gradient_as_bucket_view_shares_storage(pools):
    for all_views, detach_msg in pools.run(2, _bucket_view):
        assert all_views
        assert "view" in detach_msg.lower()


def _view_at_hook(rank, world_size, impl):
    # A weight above the held-slot size (model[2]'s, 2 MiB) whose bucket,
    # before and after the rebuild, fills only with the first layer's
    # gradients (the last layer's 1.2 MiB close the rebuild's first bucket).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 600))
    wrap = gradring.DistributedDataParallel if impl == "gradring" else \
        nn.parallel.DistributedDataParallel
    ddp = wrap(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    big = model[2].weight
    seen = []
    # Runs once the last layer's gradients are in and before the first
    # layer's backward: is the large .grad already its bucket view there?
    model[0].register_full_backward_pre_hook(
        lambda *_: seen.append(big.grad is not None and big.grad._is_view()))
    torch.manual_seed(rank)
    grads = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 16)).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return seen, grads


def test_gradient_as_bucket_view_points_a_large_grad_at_its_slot_at_its_hook(pools):
    # torch's DDP copies a new gradient into its view and lets it go at the
    # gradient's own hook, so a bucket's new gradients never live all at once
    # (the memory gradient_as_bucket_view saves); gradring's large slots do
    # the same. The results are the same bits.
    theirs = pools.run(2, _view_at_hook, "torch")
    ours = pools.run(2, _view_at_hook, "gradring")
    for (seen_t, grads_t), (seen_g, grads_g) in zip(theirs, ours):
        assert seen_t == [True] * 4
        assert seen_g == seen_t
        for step_t, step_g in zip(grads_t, grads_g):
            assert all(torch.equal(a, b) for a, b in zip(step_t, step_g))
