"""backward(create_graph=True) through DDP, against torch's DDP: gradients that
carry a graph, a case where torch fails (the oracle is then torch without
create_graph), and a gradient penalty on the input's gradient."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tests.support.irregular_models import compare_grads
from tests.support.side_by_side import IMPLS, _grads


class _Power(nn.Module):
    """One parameter; its gradient depends on it, so create_graph gives a graph."""

    def __init__(self, shape: tuple[int, ...], second: bool = False) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.full(shape, 1.5, dtype=torch.float64))
        self.q = nn.Parameter(torch.full((3,), 0.5, dtype=torch.float64)) if second else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (self.p * x).pow(2).sum()
        if self.q is not None:
            out = out + self.q.pow(3).sum() * x.sum()
        return out


def _create_graph(rank, world_size, shape, second, create_graph):
    x = torch.arange(3, dtype=torch.float64) + rank
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(_Power(shape, second))
        steps = []
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(3):  # .grad accumulates across the steps
                    ddp(x).backward(create_graph=create_graph)
                    steps.append([(p.grad.requires_grad, p.grad.detach().clone())
                                  for p in ddp.module.parameters()])
            out[name] = steps
        except RuntimeError as e:
            out[name] = f"error: {e}"
        for p in ddp.module.parameters():
            p.grad = None  # break the parameter <-> .grad cycle create_graph makes
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("shape", [(), (3,)])
def test_create_graph_matches_torch(pools, world_size, shape):
    for r in pools.run(world_size, _create_graph, shape, False, True):
        assert not isinstance(r["torch"], str), r["torch"]
        assert not isinstance(r["gradring"], str), r["gradring"]
        for mine, theirs in zip(r["gradring"], r["torch"]):
            for (req_m, g_m), (req_t, g_t) in zip(mine, theirs):
                assert req_m and req_t  # .grad requires grad, as torch's does
                assert torch.allclose(g_m, g_t, rtol=0, atol=1e-12)


def test_create_graph_where_torch_fails_gives_plain_backwards_numbers(pools):
    # Two parameters: torch's DDP fails here ("a leaf Variable ... in-place");
    # gradring runs, and its numbers are torch's without create_graph.
    graph = pools.run(2, _create_graph, (3,), True, True)
    plain = pools.run(2, _create_graph, (3,), True, False)
    for g, p in zip(graph, plain):
        assert not isinstance(g["gradring"], str), g["gradring"]
        for mine, theirs in zip(g["gradring"], p["torch"]):
            for (req, g_m), (_, g_t) in zip(mine, theirs):
                assert req
                assert torch.allclose(g_m, g_t, rtol=0, atol=1e-12)


class _Mlp(nn.Module):
    def __init__(self, idle: bool) -> None:
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 1)
        self.idle = nn.Linear(5, 5) if idle else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _gradient_penalty(rank, world_size, kwargs):
    torch.manual_seed(0)
    base = _Mlp(idle=bool(kwargs.get("find_unused_parameters"))).double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
            y = ddp(x)
            # WGAN-GP style: the penalty on d(out)/d(input), built with create_graph.
            (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            loss = y.pow(2).mean() + 0.1 * (gx.norm(dim=1) - 1).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            steps.append(_grads(ddp.module))
            opt.step()
        out[name] = steps
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True}],
                         ids=["default", "find_unused"])
def test_gradient_penalty_matches_torch(pools, world_size, kwargs):
    for r in pools.run(world_size, _gradient_penalty, kwargs):
        assert compare_grads(r["gradring"], r["torch"], tol=1e-12) is None
