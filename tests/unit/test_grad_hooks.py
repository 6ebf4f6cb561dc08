"""GradHooks (gradring/reducer/grad_hooks.py) with a recording callback, no
process group: where the reducer's hook runs among a user's, and what moves it
(see [Note: where the hooks sit])."""

from __future__ import annotations

import torch
from torch import nn

from gradring.reducer.grad_hooks import GradHooks


def _backward(params: list[nn.Parameter]) -> None:
    sum((p * p).sum() for p in params).backward()


def _recording(params: list[nn.Parameter]) -> tuple[GradHooks, list[str]]:
    calls: list[str] = []
    return GradHooks(params, lambda i, *_: calls.append(f"reducer{i}")), calls


def test_a_hook_registered_after_wrapping_runs_first_until_settle() -> None:
    p = nn.Parameter(torch.ones(3))
    hooks, calls = _recording([p])
    p.register_post_accumulate_grad_hook(lambda _: calls.append("user"))
    hooks.follow()  # what the reducer does before each backward
    _backward([p])
    assert calls == ["user", "reducer0"]
    hooks.settle()
    p.register_post_accumulate_grad_hook(lambda _: calls.append("late"))
    hooks.follow()  # settled: nothing moves any more
    calls.clear()
    _backward([p])
    assert calls == ["user", "reducer0", "late"]


def test_the_hook_outlives_a_kept_graph_and_a_dtype_change() -> None:
    """A loop that keeps ``loss`` until the next forward reuses the accumulator;
    a ``.data`` of another dtype replaces it. The hook is the tensor's, so it is
    heard once per backward either way."""
    p = nn.Parameter(torch.ones(3))
    hooks, calls = _recording([p])
    loss = None
    for step in range(4):
        hooks.follow()
        loss = (p * p).sum()
        loss.backward()
        if step == 1:
            hooks.settle()
        assert calls == ["reducer0"] * (step + 1)
    p.data = p.data.double()
    loss = (p * p).sum()
    loss.backward()
    assert calls == ["reducer0"] * 5


def test_counting_replaces_the_hook_in_place_even_on_a_frozen_parameter() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    hooks, calls = _recording([a, b])
    b.register_post_accumulate_grad_hook(lambda _: calls.append("user"))
    hooks.settle()
    b.requires_grad_(False)  # frozen since: it takes no new hook, yet its hook changes
    arrived: list[torch.Tensor] = []
    hooks.count_with([None, arrived.append])
    b.requires_grad_(True)
    _backward([a, b])
    assert sorted(calls) == ["reducer0", "user"]
    assert len(arrived) == 1 and arrived[0] is b
    hooks.count_with([None, None])  # back to the reducer's, in the same place: after the user's
    calls.clear()
    _backward([a, b])
    assert sorted(calls) == ["reducer0", "reducer1", "user"]
    assert calls.index("user") < calls.index("reducer1")
    hooks.remove_all()
    calls.clear()
    _backward([a, b])
    assert calls == ["user"]
