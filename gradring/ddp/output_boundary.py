"""The autograd Function placed around the forward's outputs.

It is an identity in forward that hands out copies, so the caller may
modify the outputs in place (``loss /= 10``), as torch's DDP allows. In
backward it does two things:
- grads of outputs the loss never used arrive as None and are passed on as
  None, so no zero tensors are materialised for them;
- in static_graph's first iteration it queues the delayed all-reduce that
  runs after the whole backward (see Reducer.delay_all_reduce).
It is applied only when find_unused_parameters is on without static_graph,
or in static_graph's first iteration.
"""

from __future__ import annotations

from typing import Any

import torch

from gradring import pytree


class _OutputBoundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, reducer: Any, clone: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.reducer = reducer
        # Copies, not views: an in-place change of a custom Function's view
        # output is an autograd error. Without ``clone`` (torch's
        # _set_ddp_sink_clone(False)) the tensors are handed out as they are.
        return tuple(t.clone() for t in tensors) if clone else tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.reducer.on_boundary_backward()
        return (None, None, *grads)


def wrap_outputs(out: Any, reducer: Any, *, clone: bool = True) -> Any:
    """Route every tensor of ``out`` that has a grad_fn through the boundary Function.

    Tensors without one (inputs passed through, leaves such as a parameter
    returned as is) are left alone, as torch's DDP leaves them. Containers
    are walked by [Note: container rules] (``gradring/pytree.py``)."""
    tensors = [t for t in pytree.tensors(out) if t.grad_fn is not None]
    if not tensors:
        return out
    wrapped = _OutputBoundary.apply(reducer, clone, *tensors)
    mapping = {id(t): w for t, w in zip(tensors, wrapped)}
    return pytree.map_tensors(lambda t: mapping.get(id(t), t), out)
