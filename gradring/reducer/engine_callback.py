"""Running a callback at the end of the autograd engine's backward, compiled autograd included."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch


def queue_engine_callback(fn: Callable[[], None], *, needs_backward_end: bool = False) -> None:
    """Run ``fn`` when the autograd engine finishes this backward.
    ``needs_backward_end``: ``fn`` must see the whole backward ended
    (static_graph's delayed all-reduce); refused under compiled autograd.

    [Note: compiled autograd]
    Under compiled autograd the backward runs as one compiled function; the
    gradient hooks (modules Dynamo never traces, see ``gradring/compile/never_traced.py``)
    are graph breaks inside it and run eagerly, in backward order, so the
    buckets still launch while later pieces of the backward compute. The
    engine's final callbacks are not available there (Dynamo only accepts
    ``queue_callback`` in a full graph), so the finalize runs as soon as the
    last bucket has launched: every parameter's gradient is in by then, and
    what is left of the backward (gradients of inputs) runs after it instead
    of beside it. static_graph's first iteration, whose reduction has to wait
    for the end of a backward it cannot see coming, is refused.
    """
    if in_compiled_autograd():
        if needs_backward_end:
            raise RuntimeError(_STATIC_UNDER_CA)
        fn()
        return
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_STATIC_UNDER_CA = (
    "static_graph=True: the first iteration cannot run under compiled autograd "
    "(its delayed all-reduce must run when the whole backward ended, which compiled "
    "autograd does not report). Run the first backward with compiled autograd off, "
    "then turn it on."
)


def in_compiled_autograd() -> bool:
    """Whether a compiled-autograd backward is running (without importing Dynamo)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(ca.in_compiled_autograd_region)
