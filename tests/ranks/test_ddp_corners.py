"""The corners of torch's DDP semantics, each run side by side with torch's own DDP.

Every rank body trains gradring's and torch's DistributedDataParallel (gloo)
on the same seeds and inputs in the same rank processes and returns both
results; the test compares them. Where torch fails and gradring does not,
the oracle is torch on a scenario that gives the same numbers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradring
from tests.support.irregular_models import compare_grads

IMPLS = {"gradring": gradring.DistributedDataParallel,
         "torch": torch.nn.parallel.DistributedDataParallel}


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _same_everywhere(t: torch.Tensor) -> bool:
    """Whether every rank holds the same values of ``t``."""
    flat = t.detach().reshape(-1).double()
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ------------------------------------------------------------- create_graph


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


# ------------------------------------------------ shared gradient accumulators


class _SharedBias(nn.Module):
    """torch's issue 41324: ``net1.bias`` and ``bias`` are one parameter, unused."""

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


# ------------------------------------------------- nested DDP, nested outputs


class _Nested(nn.Module):
    """Returns its outputs nested as a tuple, a list and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.x = nn.Linear(6, 2)
        self.y = nn.Linear(6, 3)
        self.z = nn.Linear(6, 1)

    def forward(self, inp: torch.Tensor):
        h = torch.tanh(self.trunk(inp))
        return (self.x(h), [self.y(h), {"z": self.z(h), "h": h}])


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


# ----------------------------------- no_sync, find_unused, rank-dependent flow


class _RankBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool, use_c: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = h + self.b(h)
        if use_c:
            h = h * torch.sigmoid(self.c(h))
        return self.head(h)


def _no_sync_rank_flow(rank, world_size, accumulate):
    torch.manual_seed(0)
    base = _RankBranch().double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x = torch.randn(3, 4, generator=g, dtype=torch.float64)
                use_b = (rank + micro) % 2 == 0          # differs between ranks
                use_c = rank == world_size - 1 and step != 1
                ctx = ddp.no_sync() if micro < accumulate - 1 else _nullcontext()
                with ctx:
                    ddp(x, use_b, use_c).pow(2).mean().backward()
            steps.append(_grads(ddp.module))
            opt.step()
        out[name] = steps
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_with_find_unused_and_rank_dependent_flow(pools, world_size):
    for r in pools.run(world_size, _no_sync_rank_flow, 3):
        assert compare_grads(r["gradring"], r["torch"], tol=1e-12) is None


# ------------------------------------------------------- reassigned buffers


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.seen


def _reassigned_buffer(rank, world_size, where):
    torch.manual_seed(0)
    base = _Counter().double()
    out = {}
    for name, cls in IMPLS.items():
        model = copy.deepcopy(base)
        ddp = cls(model)
        seen = []
        for step in range(3):
            # A new tensor each time, different on every rank.
            model.seen = model.seen + (rank + 1) * (step + 1)
            y = ddp(torch.ones(2, 3, dtype=torch.float64))
            seen.append((model.seen.clone(), y.detach().clone()))
            y.sum().backward()
        if where == "join":
            with ddp.join():
                model.seen = model.seen + 100 * (rank + 1)
                ddp(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
            seen.append((model.seen.clone(), None))
        out[name] = seen
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reassigned_buffer_is_broadcast_from_rank0(pools, world_size):
    for r in pools.run(world_size, _reassigned_buffer, "forward"):
        for (buf_m, y_m), (buf_t, y_t) in zip(r["gradring"], r["torch"]):
            assert torch.equal(buf_m, buf_t) and torch.equal(y_m, y_t)


def test_reassigned_buffer_under_join(pools):
    # Join's final sync also reads the buffer the module holds now.
    for r in pools.run(2, _reassigned_buffer, "join"):
        for (buf_m, _), (buf_t, _) in zip(r["gradring"], r["torch"]):
            assert torch.equal(buf_m, buf_t)
