"""Parameters without a gradient, under find_unused_parameters and static_graph,
against torch's DDP: one parameter under two names that no forward uses, a
weight tied between layers, heads of nested outputs left out of the loss, and a
parameter frozen after wrapping then unfrozen.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.irregular_models import compare_grads
from tests.support.side_by_side import BOTH, IMPLS, Net, _equal, _grads, _Nested, _state, _train


class _SharedBias(nn.Module):
    """``net1.bias`` and ``bias`` are one parameter under two names and the forward
    uses neither: one gradient accumulator, shared by both names, that never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(6, 4, bias=False)
        self.bias = nn.Parameter(torch.zeros(4))
        self.net1.bias = self.bias
        self.net2 = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(x).sum()


class _Tied(nn.Module):
    """One weight used by two layers, and twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.idle = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(torch.relu(self.a(x))) + self.a(x)).pow(2).sum()


def _shared(rank, world_size, kind, kwargs):
    torch.manual_seed(0)
    base = {"shared_bias": _SharedBias, "tied": _Tied}[kind]().double()
    dim = 6 if kind == "shared_bias" else 4
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = []
        for step in range(4):
            g = torch.Generator().manual_seed(10 * step + rank)
            loss = ddp(torch.randn(5, dim, generator=g, dtype=torch.float64))
            loss /= 10  # in place on DDP's output, as torch's own test does
            opt.zero_grad(set_to_none=True)
            loss.backward()
            steps.append(_grads(ddp.module))
            opt.step()
        out[name] = steps
    return out


@pytest.mark.parametrize("kind", ["shared_bias", "tied"])
@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True},
                                    {"find_unused_parameters": True, "static_graph": True},
                                    {"static_graph": True}],
                         ids=["find_unused", "find_unused_static", "static"])
def test_shared_grad_accumulators_match_torch(pools, kind, kwargs):
    for r in pools.run(2, _shared, kind, kwargs):
        assert compare_grads(r["gradring"], r["torch"], tol=1e-12) is None


def _nested_outputs(rank, world_size, kwargs):
    torch.manual_seed(0)
    base = _Nested().double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), **kwargs)
        steps, shape, error = [], None, None
        try:
            for step in range(3):
                g = torch.Generator().manual_seed(10 * step + rank)
                res = ddp(torch.randn(3, 4, generator=g, dtype=torch.float64))
                shape = (type(res).__name__, type(res[1]).__name__, type(res[1][1]).__name__)
                a, (b, _d) = res
                ddp.zero_grad(set_to_none=True)
                (a.sum() + b.pow(2).sum()).backward()  # "z" and "h" unused in the loss
                steps.append(_grads(ddp.module))
        except RuntimeError as e:
            error = str(e).split(". ")[0]
        out[name] = (shape, steps, error)
    return out


@pytest.mark.parametrize("kwargs", [{"find_unused_parameters": True}, {"static_graph": True},
                                    {"find_unused_parameters": True, "static_graph": True}],
                         ids=["find_unused", "static", "both"])
def test_nested_outputs_match_torch(pools, kwargs):
    for r in pools.run(2, _nested_outputs, kwargs):
        assert r["gradring"][0] == r["torch"][0] == ("tuple", "list", "dict")
        g, t = r["gradring"][1], r["torch"][1]
        if r["torch"][2] is not None:  # the last step's reduction never finished
            g, t = g[:-1], t[:-1]
        assert compare_grads(g, t, tol=1e-12) is None
        # static_graph: the first iteration's boundary lets the unused head's
        # hooks fire, so it counts as used and is missed after; torch agrees.
        assert r["gradring"][2] == r["torch"][2]
        assert (r["torch"][2] is not None) == ("static_graph" in kwargs)


def _frozen_after_wrapping(rank: int, world: int) -> dict:
    """A parameter frozen after wrapping and unfrozen later (a backbone
    trained only from some epoch on), with find_unused_parameters."""
    out = {}
    for name, impl in BOTH:
        model = Net().double()
        ddp = impl(model, find_unused_parameters=True)
        model.fc1.weight.requires_grad_(False)
        _train(ddp, rank, steps=3)
        model.fc1.weight.requires_grad_(True)
        _train(ddp, rank, steps=2)
        out[name] = _state(model)
    return {"diff": _equal(out["theirs"], out["ours"], world),
            "grad": "grad:fc1.weight" in out["ours"]}


@pytest.mark.timeout(180)
def test_parameter_frozen_after_wrapping_then_unfrozen_as_torch(pools) -> None:
    for r in pools.run(2, _frozen_after_wrapping):
        assert r["diff"] == [] and r["grad"], r
