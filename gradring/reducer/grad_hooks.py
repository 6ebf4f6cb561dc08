"""Each parameter's gradient hook: where it sits, and how it moves.

[Note: where the hooks sit]
The reducer hears of a gradient through a hook that autograd runs once the
gradient is accumulated into ``.grad``. There are two places for it:

- the parameter's gradient accumulator, the ``AccumulateGrad`` node autograd
  makes for a leaf (torch's own C++ reducer hooks there). Its hooks run
  after the tensor's own post-accumulate hooks, so a user's hook registered
  after wrapping still changes what is reduced, as under torch's DDP. The
  tensor keeps only a weak reference to that node, so this object holds it;
- the parameter itself (``register_post_accumulate_grad_hook``), about 1 us
  cheaper per call (autograd builds no argument tuples), and kept through
  what replaces an accumulator.

The hooks start *provisional*, on the accumulators, and ``settle`` moves
every one to the tensor once the bucket order is final (or after two
synchronised backwards where it never becomes final). A user's
post-accumulate hook registered before that point still runs before the
reducer's, which covers registering hooks right after wrapping.

Changing a parameter's dtype or device through ``.data`` makes autograd
drop its accumulator, and a provisional hook with it; DDP's own mixed
precision does that at every forward. So after each forward, while hooks
are provisional, ``follow`` checks every parameter's accumulator and moves
the hook of one that changed to the tensor (about 1 us per parameter, for
the first two iterations or so). A parameter frozen since the reducer was
built (``requires_grad_(False)``) cannot take a tensor hook: it keeps its
accumulator and the hook on it, as under torch's DDP, so that it is heard
from again once unfrozen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

# What autograd calls: a tensor hook with the parameter, an accumulator's hook
# with its argument tuples; the reducer's callback ignores both.
Hook = Callable[..., Any]


class GradHooks:
    """The reducer's hook on each parameter: provisional on the accumulator
    until ``settle``, then on the tensor."""

    def __init__(self, params: Sequence[torch.Tensor], on_grad: Hook) -> None:
        self._params = list(params)
        # on_grad(i, *what_autograd_passes) for parameter i.
        self._on_grad = on_grad
        # Per parameter: the hook's handle, or None while it has none.
        self._handles: list[Any] = []
        # Per parameter: the accumulator a provisional hook sits on (held, so
        # that the hook lives across forwards), or None.
        self._nodes: list[Any] = []
        # Whether remove_all() ran: no hooks for good.
        self.removed = False
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                node = _accumulator(p)
                hook = self._hook(i)
                if node is None:
                    self._handles.append(p.register_post_accumulate_grad_hook(hook))
                else:
                    self._handles.append(node.register_hook(hook))
                self._nodes.append(node)
        self._provisional = any(n is not None for n in self._nodes)
        # Per parameter: the builtin that counts its arrival instead of the
        # reducer's hook, or None ([Note: counted slots] in buckets/packed.py).
        self._counters: list[Any] = [None] * len(self._params)

    def _hook(self, i: int) -> Hook:
        # A partial of a partial is one partial: still no Python frame of its own.
        return functools.partial(self._on_grad, i)

    @property
    def provisional(self) -> bool:
        """Whether the hooks are still provisional (neither ``settle`` nor
        ``remove_all`` ran, and some hook sits on an accumulator)."""
        return self._provisional

    def follow(self) -> None:
        """After a forward, while some hooks are provisional: move the hook of
        each parameter whose accumulator was replaced (its ``.data`` changed
        dtype or device, as mixed precision's forward does) to the tensor,
        which keeps it through such changes."""
        if not self._provisional:
            return
        handles, nodes = self._handles, self._nodes
        with torch.enable_grad():
            for i, p in enumerate(self._params):
                node = nodes[i]
                if node is not None and p.requires_grad and _accumulator(p) is not node:
                    handles[i].remove()
                    nodes[i] = None
                    handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))
        self._provisional = any(n is not None for n in nodes)

    def settle(self) -> None:
        """Move every hook to its tensor and drop the accumulators (see [Note:
        where the hooks sit])."""
        if self.removed or not self._provisional:
            return
        handles, nodes = self._handles, self._nodes
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                # Frozen since the reducer was built: a tensor takes no hook
                # then. Its hook stays where it is (on the accumulator, which
                # is kept, as torch keeps it), for when it is unfrozen.
                continue
            if nodes[i] is not None:
                handles[i].remove()
                nodes[i] = None
                handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))
        self._provisional = False

    def on_tensor(self) -> list[bool]:
        """Per parameter, whether its hook sits on the tensor (a builtin can
        take it: autograd calls it with the parameter alone)."""
        if self.removed:
            return [False] * len(self._params)
        return [h is not None and n is None for h, n in zip(self._handles, self._nodes)]

    def count_with(self, counters: Sequence[Any]) -> None:
        """Make parameter ``i``'s hook ``counters[i]`` where that is not None,
        else the reducer's; only hooks that sit on tensors change."""
        if self.removed:
            return
        handles, nodes, now = self._handles, self._nodes, self._counters
        for i, p in enumerate(self._params):
            want = counters[i]
            if nodes[i] is not None or handles[i] is None or want == now[i]:
                continue
            handles[i].remove()
            handles[i] = p.register_post_accumulate_grad_hook(
                want if want is not None else self._hook(i))
            now[i] = want

    def remove_all(self) -> None:
        """Take every hook away for good (the wrapper is detached)."""
        for h in self._handles:
            if h is not None:
                h.remove()
        self._handles.clear()
        self._nodes = [None] * len(self._params)
        self._counters = [None] * len(self._params)
        self._provisional = False
        self.removed = True


def _accumulator(p: torch.Tensor) -> Any:
    """``p``'s gradient accumulator (made now if it has none), or None where
    ``p`` has none (it does not require a gradient, or is not a leaf)."""
    if not p.requires_grad or p.grad_fn is not None:
        return None
    node = get_gradient_edge(p).node
    return node if type(node).__name__ == "AccumulateGrad" else None
