"""Forwards and backwards other than one forward then one backward, against torch's
DDP: forwards under no_grad or in eval mode, two backwards through one graph, two
losses in one backward, and a backward with the optimizer step run inside
DDP's forward through the reducer's methods (Lightning's manual optimization)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks
from torch import nn

import gradring
from tests.support.irregular_models import compare_grads
from tests.support.side_by_side import IMPLS, _flat_params, _grads, _same_everywhere


def _no_grad_and_eval_leave_reducer_alone(rank, world_size):
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(nn.Linear(3, 3))
    with torch.no_grad():
        ddp(torch.randn(2, 3))
        ddp(torch.randn(2, 3))
    ddp.eval()
    ddp(torch.randn(2, 3))  # grad enabled, eval mode: prepares but never backwards
    ddp.train()
    x = torch.full((2, 3), float(rank))
    ddp(x).sum().backward()
    g = ddp.module.weight.grad.clone()
    expected = torch.full((3, 3), 2.0 * sum(range(world_size)) / world_size)
    return torch.allclose(g, expected)


def test_no_grad_and_eval_forward(pools):
    assert pools.run(2, _no_grad_and_eval_leave_reducer_alone) == [True, True]


def _backward_twice(rank, world_size):
    """torch's DDP averages the first backward and only accumulates the second
    one locally; gradring does the same and says so, once, as its own notice
    (the gradring logger), naming the user's line."""
    from tests.support.notices import notices

    out = {}
    for name, cls in (("ours", gradring.DistributedDataParallel),
                      ("theirs", torch.nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = cls(nn.Linear(3, 3).double())
        x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        loss = ddp(x).sum()
        loss.backward(retain_graph=True)
        with warnings.catch_warnings(), notices() as seen:
            warnings.simplefilter("error")  # not a Python warning: cannot become an error
            loss.backward()
        out[name] = ([p.grad.clone() for p in ddp.parameters()],
                     [m for m in seen if "second time" in m])
    return {"same": all(torch.equal(a, b) for a, b in zip(out["ours"][0], out["theirs"][0])),
            "warned": out["ours"][1]}


def test_backward_twice_accumulates_locally_with_a_warning(pools):
    for r in pools.run(2, _backward_twice):
        assert r["same"], r
        assert len(r["warned"]) == 1 and "NOT averaged" in r["warned"][0], r
        assert "test_ddp_forward_backward_patterns.py:" in r["warned"][0], r  # the user's line


def _two_losses(rank, world_size, how, kwargs):
    torch.manual_seed(0)
    base = nn.Linear(3, 2).double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), **kwargs)
        steps, error = [], None
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            y = ddp(torch.randn(4, 3, generator=g, dtype=torch.float64))
            l1, l2 = y.pow(2).sum(), 3 * y.sum()
            ddp.zero_grad(set_to_none=True)
            try:
                if how == "retain_graph":
                    l1.backward(retain_graph=True)
                    l2.backward()
                elif how == "together":
                    torch.autograd.backward([l1, l2])
                else:
                    (l1 + l2).backward()
            except RuntimeError as e:
                error = str(e)
                break
            steps.append(_grads(ddp.module))
        grads = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
        out[name] = (steps, error, _same_everywhere(grads))
    return out


@pytest.mark.parametrize("how", ["together", "summed"])
@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_two_losses_in_one_backward_match_torch(pools, how, kwargs):
    for r in pools.run(2, _two_losses, how, kwargs):
        assert r["gradring"][1] is None and r["torch"][1] is None
        assert compare_grads(r["gradring"][0], r["torch"][0], tol=1e-12) is None
        assert r["gradring"][2] and r["torch"][2]


def test_two_backwards_from_one_forward_behave_like_torch(pools):
    # torch reduces the first backward and leaves the second one's gradients
    # local: its replicas drift apart. gradring does exactly the same (it must
    # not break this pattern) and warns once (docs/ddp-differences.md).
    for r in pools.run(2, _two_losses, "retain_graph", {}):
        assert r["torch"][1] is None and not r["torch"][2]
        assert r["gradring"][1] is None and not r["gradring"][2]
        assert compare_grads(r["gradring"][0], r["torch"][0], tol=0.0) is None


class _ManualStep(nn.Module):
    """A LightningModule-like body: training_step runs backward and the
    optimizer step itself, while DDP's forward is still running."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)
        self.ddp = None
        self.opt = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.b(torch.tanh(self.a(x))).pow(2).mean()
        ddp = self.ddp
        # What Lightning's DDPStrategy.pre_backward does for manual optimization.
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            ddp.require_forward_param_sync = True
            tensors = [loss] if ddp.find_unused_parameters and not ddp.static_graph else []
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward(tensors)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        # ... and what its post_backward does in static_graph's first iteration.
        if ddp.static_graph and not getattr(self, "delayed", False):
            ddp.reducer._delay_all_reduce()
            self.delayed = True
        self.opt.step()
        # Lightning's _DDPForwardRedirection: the reduction is done, so DDP's
        # own post-forward must not prepare another one.
        ddp.require_backward_grad_sync = False
        return loss.detach()


def _manual_inside_forward(rank, world_size, kwargs):
    torch.manual_seed(0)
    base = _ManualStep().double()
    out = {}
    for name, cls in IMPLS.items():
        module = copy.deepcopy(base)
        ddp = cls(module, **kwargs)
        calls: list[int] = []

        def counting(state, bucket, calls=calls):
            calls.append(1)
            return default_hooks.allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting)
        module.ddp, module.opt = ddp, torch.optim.SGD(module.parameters(), lr=0.1)
        reductions = []
        for step in range(5):
            g = torch.Generator().manual_seed(10 * step + rank)
            before = len(calls)
            ddp(torch.randn(3, 4, generator=g, dtype=torch.float64))
            ddp.require_backward_grad_sync = True
            reductions.append(len(calls) - before)
        out[name] = (_flat_params(module), reductions, _same_everywhere(_flat_params(module)))
        module.ddp = module.opt = None
    return out


@pytest.mark.parametrize("kwargs", [{}, {"find_unused_parameters": True},
                                    {"static_graph": True}],
                         ids=["default", "find_unused", "static"])
def test_manual_backward_inside_forward_matches_torch(pools, kwargs):
    for r in pools.run(2, _manual_inside_forward, kwargs):
        params_m, red_m, same_m = r["gradring"]
        params_t, red_t, same_t = r["torch"]
        assert same_m and same_t  # replicas identical after every step
        assert red_m == red_t and all(n > 0 for n in red_m)  # reduced once per step
        assert torch.allclose(params_m, params_t, rtol=0, atol=1e-12)
