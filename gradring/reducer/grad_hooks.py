"""Each parameter's gradient hook: where it sits, and how it moves.

[Note: where the hooks sit]
The reducer hears of a gradient through a hook that autograd runs once the
gradient is accumulated into ``.grad``: a ``register_post_accumulate_grad_hook``
on the parameter itself. Under torch's DDP the C++ reducer hooks the
parameter's ``AccumulateGrad`` node instead, whose hooks run after the
tensor's own; so a user's post-accumulate hook registered after wrapping
still changes what is reduced there. Here the hooks start *provisional*:
before each backward, ``follow`` puts the reducer's hook last among the
parameter's hooks again, until ``settle`` once the bucket order is final
(or after two synchronised backwards where it never becomes final), which
covers registering hooks right after wrapping.

The hooks were once on the accumulators while provisional. A node keeps
the C++ wrapper of a removed Python hook, which builds its argument tuples
on every call (about 1 us a parameter a backward, measured), and a node
lives as long as a graph holds it: in a loop that keeps ``loss`` until the
next forward, that forward reuses the node, so the first node and its dead
wrapper lived for the whole run. Tensor hooks survive what replaces an
accumulator (a ``.data`` of another dtype or device, as DDP's own mixed
precision does at every forward) and a parameter frozen and unfrozen.

The accumulators are still held, with nothing on them, as torch's reducer
holds its own: each forward reuses them, where a plain model makes one per
parameter per step and frees it with the graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge

# What autograd calls with the parameter.
Hook = Callable[..., Any]


class GradHooks:
    """The reducer's hook on each parameter, kept last among the parameter's
    hooks until ``settle``."""

    def __init__(self, params: Sequence[torch.Tensor], on_grad: Hook) -> None:
        self._params = list(params)
        # on_grad(i, *what_autograd_passes) for parameter i.
        self._on_grad = on_grad
        # Per parameter: the hook's handle, or None once remove_all() ran.
        self._handles: list[Any] = [p.register_post_accumulate_grad_hook(self._hook(i))
                                    for i, p in enumerate(self._params)]
        # Whether the hooks are still moved behind the user's (see the Note).
        self._provisional = True
        # Whether remove_all() ran: no hooks for good.
        self.removed = False
        # Per parameter: the builtin that counts its arrival instead of the
        # reducer's hook, or None ([Note: counted slots] in buckets/packed.py).
        self._counters: list[Any] = [None] * len(self._params)
        # Each parameter's gradient accumulator, held (as torch's reducer holds
        # them) so that each forward reuses it instead of making a new one that
        # the end of the step frees. Nothing is hooked on them.
        with torch.enable_grad():
            self._accumulators = [get_gradient_edge(p).node for p in self._params]

    def _hook(self, i: int) -> Hook:
        # A partial of a partial is one partial: still no Python frame of its own.
        return functools.partial(self._on_grad, i)

    @property
    def provisional(self) -> bool:
        """Whether the hooks are still provisional (neither ``settle`` nor
        ``remove_all`` ran)."""
        return self._provisional

    def follow(self) -> None:
        """Before a backward, while the hooks are provisional: make the
        reducer's hook the last of each parameter's post-accumulate hooks, so
        that a user's hook registered since runs before it, as under torch's
        DDP. Autograd calls them in the dict's insertion order, which a pop
        and a new insertion sets."""
        if not self._provisional:
            return
        for p, handle in zip(self._params, self._handles):
            hooks = p._post_accumulate_grad_hooks
            if hooks is not None and len(hooks) > 1 and next(reversed(hooks)) != handle.id:
                hooks[handle.id] = hooks.pop(handle.id)

    def settle(self) -> None:
        """The hooks stay where they are from now on (see [Note: where the hooks sit])."""
        if self.removed or not self._provisional:
            return
        self.follow()
        self._provisional = False

    def on_tensor(self) -> list[bool]:
        """Per parameter, whether its hook sits on the tensor (a builtin can
        take it: autograd calls it with the parameter alone): all of them,
        until remove_all()."""
        return [not self.removed] * len(self._params)

    def count_with(self, counters: Sequence[Any]) -> None:
        """Make parameter ``i``'s hook ``counters[i]`` where that is not None,
        else the reducer's. The function is replaced under the hook's own key,
        so it keeps its place among the parameter's hooks (and a parameter
        frozen since, which takes no new hook, changes too)."""
        if self.removed:
            return
        handles, now = self._handles, self._counters
        for i, p in enumerate(self._params):
            want = counters[i]
            if want == now[i]:
                continue
            p._post_accumulate_grad_hooks[handles[i].id] = (
                want if want is not None else self._hook(i))
            now[i] = want

    def remove_all(self) -> None:
        """Take every hook away for good (the wrapper is detached)."""
        for h in self._handles:
            if h is not None:
                h.remove()
        self._handles.clear()
        self._accumulators.clear()
        self._counters = [None] * len(self._params)
        self._provisional = False
        self.removed = True

