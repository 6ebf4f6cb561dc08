"""Small parameters (packed slots) beside large ones, differentially against
torch's DDP: the gradients bit for bit over zero_grad, accumulation and
no_sync patterns, the errors of a parameter that got no gradient, and a
synchronised forward that no backward follows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradring


class Mixed(nn.Module):
    """Small parameters (packed slots) beside one large one, each used once."""

    def __init__(self, n_small: int = 12) -> None:
        super().__init__()
        self.big = nn.Linear(96, 96)  # 9,216 elements: not packed
        self.small = nn.ParameterList(
            [nn.Parameter(torch.randn(96) * 0.1) for _ in range(n_small)])
        self.skip: set[int] = set()  # small parameters the next forward leaves out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.big(x))
        for k, p in enumerate(self.small):
            if k not in self.skip:
                x = torch.tanh(x * (1 + p))
        return x


# What each step does around its backward: "none" zero_grad(set_to_none=True)
# before the forward, "zero" zero_grad(set_to_none=False), "accumulate" no
# zero_grad, "between" zero_grad(set_to_none=True) after the forward,
# "no_sync" a no_sync forward and backward on another batch first.
_STEPS = ["none", "none", "none", "zero", "accumulate", "between", "no_sync", "none",
          "zero", "no_sync", "between", "none"]


def _train(rank: int, impl: type, base: nn.Module, kwargs: dict) -> dict:
    model = impl(copy.deepcopy(base), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    gen = torch.Generator().manual_seed(100 + rank)
    for how in _STEPS:
        x = torch.randn(4, 96, generator=gen, dtype=torch.float64)
        if how == "none":
            opt.zero_grad(set_to_none=True)
        elif how == "zero":
            opt.zero_grad(set_to_none=False)
        elif how == "no_sync":
            with model.no_sync():
                model(x * 0.5).sum().backward()
        out = model(x)
        if how == "between":
            opt.zero_grad(set_to_none=True)
        out.sum().backward()
        grads.append([p.grad.clone() for p in model.module.parameters()])
        opt.step()
    return {"grads": grads}


def _side_by_side(rank: int, world_size: int, cap_mb: float) -> dict:
    torch.manual_seed(0)
    base = Mixed().double()
    kwargs = {"bucket_cap_mb": cap_mb}
    return {"gradring": _train(rank, gradring.DistributedDataParallel, base, kwargs),
            "torch": _train(rank, torch.nn.parallel.DistributedDataParallel, base, kwargs)}


@pytest.mark.parametrize("cap_mb", [0.01, 25.0])
def test_small_gradients_match_torch_bit_for_bit(pools, cap_mb):
    for r in pools.run(2, _side_by_side, cap_mb):
        ours, theirs = r["gradring"], r["torch"]
        assert len(ours["grads"]) == len(theirs["grads"]) == len(_STEPS)
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"])):
            for k, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), (step, _STEPS[step], k, (x - y).abs().max())


def _unused_after_rebuild(rank: int, world_size: int, which: str, impl_name: str,
                          set_to_none: bool = False) -> dict:
    impl = {"gradring": gradring.DistributedDataParallel,
            "torch": torch.nn.parallel.DistributedDataParallel}[impl_name]
    torch.manual_seed(0)
    model = impl(Mixed(n_small=6).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    events: list = []
    for step in range(6):
        if step == 3 and which == "one_small":
            model.module.skip = {4}
        x = torch.randn(4, 96, dtype=torch.float64)
        if set_to_none:
            opt.zero_grad(set_to_none=True)
        try:
            out = model(x)
            if step == 3 and which == "only_small":
                # The loss reaches the small parameters alone.
                out = sum(p.sum() for p in model.module.small)
            out.sum().backward()
            opt.step()
            events.append(("ok", step))
        except RuntimeError as e:
            events.append(("error", step, str(e)))
            break
        model.module.skip = set()
    return {"events": events}


# "one_small": a small parameter the forward leaves out, so its gradient is
# missing (the error names it). "only_small": the loss reaches the small
# parameters alone, so the large weight's gradient is missing (the error names it).
@pytest.mark.parametrize("which,named", [("one_small", "small.4"),
                                         ("only_small", "big.weight")])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_missing_gradient_raises_at_next_forward_as_torch(pools, which, named, set_to_none):
    for impl in ("torch", "gradring"):
        for r in pools.run(2, _unused_after_rebuild, which, impl, set_to_none):
            kind, step, msg = r["events"][-1]
            assert (kind, step) == ("error", 4), r["events"]
            assert "Expected to have finished reduction in the prior iteration" in msg
            if impl == "gradring":
                assert named in msg, msg


def _forward_without_backward(rank: int, world_size: int, how: str) -> dict:
    """After the rebuild, a synchronised forward that no backward follows, then
    ``how``, then training on: valid under torch's DDP, so it must be here."""
    torch.manual_seed(0)
    base = Mixed(n_small=6).double()
    out = {}
    for name, impl in (("gradring", gradring.DistributedDataParallel),
                       ("torch", torch.nn.parallel.DistributedDataParallel)):
        model = impl(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        gen = torch.Generator().manual_seed(3 + rank)
        grads, error = [], None
        try:
            for step in range(7):
                x = torch.randn(4, 96, generator=gen, dtype=torch.float64)
                if step == 3:
                    model(x)  # evaluated with grad on, never backpropagated
                    if how == "zero_grad_keep":
                        opt.zero_grad(set_to_none=False)
                    elif how == "load_weights":
                        model.module.load_state_dict(base.state_dict())
                    elif how == "step_stale":
                        opt.step()
                    continue
                opt.zero_grad(set_to_none=how != "zero_grad_keep")
                model(x).sum().backward()
                grads.append([p.grad.clone() for p in model.module.parameters()])
                opt.step()
        except RuntimeError as e:
            error = str(e)
        out[name] = {"grads": grads, "error": error}
    return out


@pytest.mark.parametrize("how", ["nothing", "zero_grad_keep", "load_weights", "step_stale"])
def test_forward_without_backward_then_training_as_torch(pools, how):
    for r in pools.run(2, _forward_without_backward, how):
        assert r["torch"]["error"] is None, r["torch"]["error"]
        assert r["gradring"]["error"] is None, r["gradring"]["error"]
        for a, b in zip(r["gradring"]["grads"], r["torch"]["grads"]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert len(r["gradring"]["grads"]) == 6
