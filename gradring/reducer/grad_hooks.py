"""Each parameter's gradient hook, and how one is taken away without a trace.

[Note: hooks that leave nothing behind]
The reducer hears of a gradient through a hook that autograd runs once the
gradient is accumulated into ``.grad``. There are two places for it:

- the parameter itself (``register_post_accumulate_grad_hook``). Such a hook
  is cheap to run, but removing it is not free: the handle empties the
  parameter's Python hook dict, while the C++ object that calls that dict
  stays on the tensor for good. Autograd then still enters Python once per
  parameter and backward to run an empty dict: 0.8 us per parameter on this
  VM, 1.6-1.9 ms a step on 2,000 small tensors (docs/collectives.md,
  "Removed hooks still cost");
- the parameter's gradient accumulator, the ``AccumulateGrad`` node autograd
  makes for a leaf (torch's own C++ reducer hooks there). The tensor keeps
  only a weak reference to that node: it lives while a graph or someone
  else holds it, and the next forward after its end makes a new one,
  without hooks. A hook there costs about 1 us more per call (autograd
  builds its argument tuples), but dropping the node takes it away entirely.

So the hooks start *provisional*, on the accumulators, which this object
holds: they record the first backward's arrival order, and for as long as
the reducer has not settled which parameters need a hook at all (see
[Note: counted at the end] in ``end_count.py``). ``settle`` then gives each
parameter that keeps one a hook on the tensor, and lets go of every
accumulator. A parameter that goes without a hook from there carries none:
its old accumulator dies with the graph that still holds it. A parameter
hooked on the tensor and unhooked later again (a comm hook registered after
the rebuild, then taken away) keeps the empty dict's cost, as before.

Every parameter the reducer gets is a leaf that requires a gradient, so it
has an accumulator; were one missing, the hook would go on the tensor from
the start. Changing a parameter's dtype or device through ``.data`` makes
autograd drop its accumulator, and a provisional hook with it; DDP's own
mixed precision does that at every forward. So after each forward, while
hooks are provisional, ``follow`` checks every parameter's accumulator and
moves the hook of one that changed to the tensor (about 1 us per parameter,
for the first two iterations or so). A parameter frozen since the reducer
was built (``requires_grad_(False)``) cannot take a tensor hook: it keeps
its accumulator and the hook on it, as under torch's DDP, so that it is
heard from again once unfrozen.
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
    until ``settle``, then on the tensor or none at all."""

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

    def settle(self, unhooked: set[int]) -> None:
        """Hook every parameter but those in ``unhooked`` on the tensor, and
        drop the accumulators (see [Note: hooks that leave nothing behind])."""
        if self.removed:
            return
        handles, nodes = self._handles, self._nodes
        for i, p in enumerate(self._params):
            if not p.requires_grad:
                # Frozen since the reducer was built: a tensor takes no hook
                # then. Its hook stays where it is (on the accumulator, which
                # is kept, as torch keeps it), for when it is unfrozen.
                if i in unhooked and handles[i] is not None:
                    handles[i].remove()
                    handles[i], nodes[i] = None, None
                continue
            on_node = nodes[i] is not None
            if handles[i] is not None and (on_node or i in unhooked):
                handles[i].remove()
                handles[i] = None
            nodes[i] = None
            if i not in unhooked and handles[i] is None:
                handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))
        self._provisional = False

    def remove_all(self) -> None:
        """Take every hook away for good (the wrapper is detached)."""
        for h in self._handles:
            if h is not None:
                h.remove()
        self._handles.clear()
        self._nodes = [None] * len(self._params)
        self._provisional = False
        self.removed = True


def _accumulator(p: torch.Tensor) -> Any:
    """``p``'s gradient accumulator (made now if it has none), or None where
    ``p`` has none (it does not require a gradient, or is not a leaf)."""
    if not p.requires_grad or p.grad_fn is not None:
        return None
    node = get_gradient_edge(p).node
    return node if type(node).__name__ == "AccumulateGrad" else None
