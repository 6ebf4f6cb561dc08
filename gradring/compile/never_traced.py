"""What Dynamo never traces: gradring's per-step machinery, and the decorator for single functions.

[Note: never traced]
Dynamo neither traces into a never-traced module (a call into it from traced
code runs eagerly) nor compiles its frames. That is what keeps the gradient
hooks eager when compiled autograd traces the backward (see [Note: compiled
autograd] in ``reducer/engine_callback.py``), and DDP's bookkeeping out of
the user's compiled graphs. The set is computed from the package, not kept
by hand: every top-level module and package of ``gradring`` is never traced
(a package covers every module under it, ``gradring.reducer`` and
``gradring.buckets`` included, whose code runs inside the hooks), except
those in ``MAY_BE_TRACED``, each for a stated reason. A new module is thus
never traced unless it is listed there. ``tests/unit/test_never_traced.py`` walks
the package and checks that every file is covered one way or the other.
"""

from __future__ import annotations

import os
import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., Any])

#: Top-level names under ``gradring`` that Dynamo may trace, and why.
MAY_BE_TRACED: dict[str, str] = {
    "nn": "SyncBatchNorm is a layer of the user's model: it compiles with it",
    "install": "setup, before any training step",
    "captures": "setup: install()'s scan of loaded modules, before any training step",
    "ray": "setup: Ray Train's model preparation, before any training step",
    "lightning": "setup: Lightning's strategy, before any training step",
    "step_model": "the tuner's pure step-time model, never inside a step",
    "tools": "command-line tools, never inside a step",
}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _never_traced() -> tuple[str, ...]:
    names = sorted(m.name for m in pkgutil.iter_modules([_ROOT]))
    return tuple(f"gradring.{n}" for n in names if n not in MAY_BE_TRACED)


#: Dotted names of gradring's never-traced modules and packages (see [Note: never traced]).
NEVER_TRACED = _never_traced()


def never_traced(*, recursive: bool) -> Callable[[_F], _F]:
    """Decorator: Dynamo never inlines the function nor compiles its frame; with
    ``recursive``, no frame it calls either. Unlike ``torch._dynamo.disable`` it
    adds no wrapper (nothing to pay per call in eager mode) and does not import
    Dynamo: it marks the code object through torch's C frame evaluator."""

    def mark(fn: _F) -> _F:
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]  # no inlining
        try:
            ev = torch._C._dynamo.eval_frame
            nested = ev._FrameAction.SKIP if recursive else ev._FrameAction.DEFAULT
            ev.set_code_exec_strategy(fn.__code__,
                                      ev._FrameExecStrategy(ev._FrameAction.SKIP, nested))
        except AttributeError:  # a torch without Dynamo's frame evaluator
            pass
        return fn
    return mark
