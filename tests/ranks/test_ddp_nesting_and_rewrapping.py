"""A DDP inside a DDP, and a module wrapped again while its first wrapper is
alive (used again, or left mid-backward), against torch's DDP or a hand-averaged
oracle."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from tests.support.irregular_models import compare_grads
from tests.support.side_by_side import IMPLS, _flat_params, _grads, _Nested, _same_everywhere


def _nested_loss(out) -> torch.Tensor:
    a, (b, d) = out
    return a.pow(2).sum() + b.sum() + d["z"].abs().sum() + 0.5 * d["h"].mean()


def _nested(rank, world_size, inner_kwargs, outer_kwargs):
    torch.manual_seed(0)
    base = _Nested().double()
    out = {}
    for name, cls in IMPLS.items():
        module = copy.deepcopy(base)
        ddp = cls(cls(module, **inner_kwargs), **outer_kwargs)
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        steps = []
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad(set_to_none=True)
            _nested_loss(ddp(torch.randn(3, 4, generator=g, dtype=torch.float64))).backward()
            steps.append(_grads(module))
            opt.step()
        out[name] = steps
    return out


@pytest.mark.parametrize("inner,outer", [
    ({}, {}),
    ({"static_graph": True}, {"static_graph": True}),
    ({}, {"static_graph": True}),
    ({"find_unused_parameters": True}, {"static_graph": True}),
], ids=["plain", "both_static", "outer_static", "inner_find_unused"])
def test_ddp_wrapping_ddp_matches_torch(pools, inner, outer):
    for r in pools.run(2, _nested, inner, outer):
        assert compare_grads(r["gradring"], r["torch"], tol=1e-12) is None


def _rewrap(rank, world_size, use_old_again, kwargs):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
    out = {}
    for name, cls in IMPLS.items():
        module = copy.deepcopy(base)
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        steps = []
        old = cls(module, **kwargs)  # the first fit
        plan = [old, old]
        new = cls(module, **kwargs)  # the second fit, while the first wrapper is alive
        plan += [new, new, new] + ([old, old] if use_old_again else [])
        for step, ddp in enumerate(plan):
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad(set_to_none=True)
            ddp(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
            steps.append(_grads(module))
            opt.step()
        out[name] = (steps, _same_everywhere(_flat_params(module)))
        del old, new
    # Oracle: a plain copy, its gradients averaged by hand.
    module = copy.deepcopy(base)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    steps = []
    for step in range(len(out["torch"][0])):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad(set_to_none=True)
        module(torch.randn(3, 4, generator=g, dtype=torch.float64)).pow(2).sum().backward()
        for p in module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        steps.append(_grads(module))
        opt.step()
    out["oracle"] = steps
    return out


@pytest.mark.parametrize("use_old_again", [False, True], ids=["new_only", "old_again"])
@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_wrapping_again_while_old_wrapper_alive(pools, use_old_again, kwargs):
    for r in pools.run(2, _rewrap, use_old_again, kwargs):
        assert compare_grads(r["gradring"][0], r["oracle"], tol=1e-12) is None
        assert r["gradring"][1]
        if "static_graph" not in kwargs:
            # With static_graph torch's old reducer joins the new one's first
            # iterations and the replicas drift apart (docs/ddp-differences.md).
            assert compare_grads(r["gradring"][0], r["torch"][0], tol=1e-12) is None
            assert r["torch"][1]


def _old_hooks_never_act(rank, world_size):
    """An old wrapper left mid-backward (its reduction unfinished) must not
    touch the new wrapper's reductions."""
    torch.manual_seed(0)
    module = nn.ModuleDict({"used": nn.Linear(3, 3), "idle": nn.Linear(3, 3)}).double()
    module.forward = lambda x: module["used"](x)
    old = gradring.DistributedDataParallel(module)
    old(torch.ones(2, 3, dtype=torch.float64)).sum().backward()  # idle: unfinished
    new = gradring.DistributedDataParallel(module, find_unused_parameters=True)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            module.zero_grad(set_to_none=True)
            x = torch.full((2, 3), float(rank + step), dtype=torch.float64)
            new(x).sum().backward()
            grads.append(module["used"].weight.grad.clone())
    return grads, old.reducer.require_finalize


def test_old_wrapper_mid_backward_leaves_new_one_alone(pools):
    results = pools.run(2, _old_hooks_never_act)
    for grads, old_pending in results:
        assert not old_pending
        for step, g in enumerate(grads):
            # mean over ranks of x = rank + step, summed over 2 rows
            assert torch.allclose(g, torch.full((3, 3), 2 * (0.5 + step), dtype=torch.float64))
