"""The reducer's graph modes, and the autograd-graph walk that finds unused parameters."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

import torch


class GraphMode(enum.Enum):
    """How the reducer learns which parameters take part in a backward.

    ``DEFAULT``: every parameter, every iteration (``find_unused_parameters``
    off). Buckets are rebuilt once, in the order gradients arrived.
    ``FIND_UNUSED``: after each forward, walk the graph from the outputs; the
    parameters not reached are marked ready at the first hook and a bitmap of
    locally used parameters is all-reduced. Buckets are never rebuilt.
    ``STATIC``: ``static_graph``: iteration 1 counts hook firings and reduces
    everything at its end; later iterations reuse the counts. Buckets are
    rebuilt once, from the second backward's arrival order.
    """

    DEFAULT = "default"
    FIND_UNUSED = "find_unused"
    STATIC = "static"

    @classmethod
    def of(cls, *, find_unused: bool, static_graph: bool) -> GraphMode:
        if static_graph:
            return cls.STATIC
        return cls.FIND_UNUSED if find_unused else cls.DEFAULT


def reachable_params(outputs: Iterable[torch.Tensor], param_index: dict[int, int]) -> set[int]:
    """Indices of parameters whose AccumulateGrad node is reachable from ``outputs``.

    ``param_index`` maps ``id(param)`` to its index. The walk is an explicit
    stack, so very deep graphs cannot hit Python's recursion limit.
    """
    found: set[int] = set()
    seen: set[Any] = set()
    stack: list[Any] = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad and id(t) in param_index:
            found.add(param_index[id(t)])
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            idx = param_index.get(id(var))
            if idx is not None:
                found.add(idx)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return found
