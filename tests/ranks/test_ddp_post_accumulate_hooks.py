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
