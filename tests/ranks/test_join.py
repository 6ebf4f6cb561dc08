"""Uneven inputs under Join, differentially against torch's DDP under torch's Join."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join

import gradring


def _model(kind):
    torch.manual_seed(0)
    if kind == "bn":
        return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    if kind == "branchy":
        from tests.support.irregular_models import Branchy
        return Branchy()
    if kind == "wide":  # a 530 KiB bucket: the homed two-shot (gradients left in .grad)
        return nn.Sequential(nn.Linear(5, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                             nn.Linear(256, 2))
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 2))


def _train_under_join(rank, world_size, impl, kind, counts, kwargs, join_kwargs):
    base = _model(kind).double()
    cls = gradring.DistributedDataParallel if impl == "gradring" else \
        torch.nn.parallel.DistributedDataParallel
    ddp = cls(copy.deepcopy(base), **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    n = counts[rank]
    dim = 6 if kind == "branchy" else 5
    error = None
    try:
        with Join([ddp], **join_kwargs):
            for step in range(n):
                g = torch.Generator().manual_seed(10 * step + rank)
                x = torch.randn(4, dim, generator=g, dtype=torch.float64)
                opt.zero_grad()
                ddp(x).pow(2).mean().backward()
                opt.step()
    except RuntimeError as e:
        error = str(e)
    params = [p.detach().clone() for p in ddp.module.parameters()]
    # With the buffers, this rank's last .grad: a joined rank's shadow steps must
    # not touch it.
    bufs = [b.clone() for b in ddp.module.buffers()] + [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        for p in ddp.module.parameters()]
    return params, bufs, error


def _both(rank, world_size, kind, counts, kwargs, join_kwargs):
    ours = _train_under_join(rank, world_size, "gradring", kind, counts, kwargs, join_kwargs)
    theirs = _train_under_join(rank, world_size, "torch", kind, counts, kwargs, join_kwargs)
    return ours, theirs


def _close(a, b):
    return all((x - y).abs().max().item() < 1e-10 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world_size,counts", [(2, [5, 2]), (3, [4, 1, 6]), (3, [0, 3, 2])])
@pytest.mark.parametrize("kind,kwargs", [
    ("mlp", {}),
    ("mlp", {"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True}),
    ("wide", {}),
    ("bn", {}),
    ("branchy", {"find_unused_parameters": True}),
])
def test_uneven_inputs_match_torch(pools, world_size, counts, kind, kwargs):
    results = pools.run(world_size, _both, kind, counts, kwargs, {}, timeout=180)
    for (p_ours, b_ours, e_ours), (p_torch, b_torch, e_torch) in results:
        assert e_ours is None and e_torch is None
        assert _close(p_ours, p_torch)
        assert _close(b_ours, b_torch)
    # every replica ends identical
    first = results[0][0][0]
    assert all(_close(first, r[0][0]) for r in results)


@pytest.mark.parametrize("kind", ["mlp", "wide"])
def test_divide_by_current_world_size(pools, kind):
    # "wide": joined ranks shadow with a plain all-reduce while the others run the
    # homed one, each scaling its own share by its own divide factor
    kw = {"divide_by_initial_world_size": False}
    for (p_ours, _, e_ours), (p_torch, _, e_torch) in pools.run(
            3, _both_join_flag, kind, [4, 1, 2], kw):
        assert e_ours is None and e_torch is None
        assert _close(p_ours, p_torch)


def _both_join_flag(rank, world_size, kind, counts, ddp_join_kwargs):
    # divide_by_initial_world_size is passed to the join hook through Join's kwargs
    return _both(rank, world_size, kind, counts, {}, ddp_join_kwargs)


def test_throw_on_early_termination(pools):
    results = pools.run(2, _train_under_join, "gradring", "mlp", [3, 1], {},
                        {"throw_on_early_termination": True})
    for _, _, err in results:
        assert err is not None
    assert "exhausted" in results[1][2] or "exhausted" in results[0][2]
