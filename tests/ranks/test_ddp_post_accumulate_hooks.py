"""A user's post-accumulate-grad hook registered after wrapping runs before the
reduction, as in torch's DDP (which hooks the gradient accumulator)."""

from __future__ import annotations

import pytest
import torch

from tests.support.side_by_side import BOTH, Net, _equal, _state, _train

pytestmark = pytest.mark.timeout(180)


def _user_post_accumulate_hooks(rank: int, world: int) -> dict:
    """A post-accumulate-grad hook registered after wrapping changes what is
    reduced: torch's DDP hooks the accumulator, which runs after it."""
    def scale(q: torch.Tensor) -> None:  # rank-dependent: the reduction shows whether it ran
        q.grad.mul_(rank + 1)

    out = {}
    for name, impl in BOTH:
        model = Net().double()
        ddp = impl(model)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(scale)
        _train(ddp, rank, steps=4)
        out[name] = _state(model)
    return {"diff": _equal(out["theirs"], out["ours"], world)}


def test_user_post_accumulate_hooks_run_before_the_reduction_as_torch(pools) -> None:
    for r in pools.run(2, _user_post_accumulate_hooks):
        assert r["diff"] == [], r


def _accumulators_across_steps(rank: int, world: int) -> dict:
    """Which step's mark each step finds on the weight's gradient accumulator, in a
    loop whose graph dies with each step: torch's reducer holds the accumulators,
    so every forward reuses the same one (a plain model makes a new one each step)."""
    from torch.autograd.graph import get_gradient_edge

    out = {}
    for name, impl in BOTH:
        model = Net().double()
        ddp = impl(model)
        weight = next(model.parameters())
        seen = []
        for step in range(4):
            ddp(torch.randn(3, 5, dtype=torch.double)).sum().backward()
            node = get_gradient_edge(weight).node
            seen.append(node.metadata.get("step"))
            node.metadata["step"] = step
            del node
        out[name] = seen
    return out


def test_the_gradient_accumulators_live_across_steps_as_under_torch(pools) -> None:
    for r in pools.run(2, _accumulators_across_steps):
        assert r["ours"] == r["theirs"] == [None, 0, 1, 2], r
