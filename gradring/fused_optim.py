"""Optimizer fused into backward: each bucket's parameters step as
soon as that bucket's reduced gradients are written, while later buckets may
still be in flight.

[Note: fused optimizer]
``ddp._register_fused_optim(optim_cls, *args, **kwargs)`` builds one
``optim_cls`` instance per parameter and hands ``FusedOptimizer.step_bucket``
to the reducer as its ``post_reduce`` callback. The reducer's finalize walks the
buckets in launch order: wait for bucket k, write its averaged gradients into
``.grad``, call ``post_reduce(bucket k)``, then wait for bucket k + 1. So the
parameters of bucket k are updated while bucket k + 1's collective may still be
running, and no ``optimizer.step()`` is needed after ``backward()``.

Why one optimizer per parameter: the reducer rebuilds its buckets after the
first iteration (new ``Bucket`` objects, new grouping), but parameters stay the
same objects, so per-parameter optimizers, and their state, survive the
rebuild. For element-wise optimizers (SGD, Adam, AdamW, RMSprop, ...) a
per-parameter instance computes exactly what one instance over all
parameters would. Optimizers that couple parameters (LBFGS, or anything that
needs a closure or a global norm) cannot be fused this way.

Which parameters step: exactly those an ``optimizer.step()`` after backward
would step, i.e. those whose ``.grad`` is not None once the bucket is written.
A parameter that no rank used (find_unused_parameters / static_graph) keeps
``.grad`` untouched by the reducer: with ``zero_grad(set_to_none=True)`` it is
None and the parameter (and its optimizer state) is left alone. torch's own
fused path steps such parameters with a zero gradient instead, which moves
them under momentum or weight decay; gradring does not.

Gradients stay in ``.grad`` after the step, as with torch: zero them before
the next backward as usual (``model.zero_grad()`` or ``fused.zero_grad()``),
or they accumulate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gradring.buckets import Bucket

__all__ = ["FusedOptimizer", "attach_fused_optimizer"]


class FusedOptimizer:
    """One optimizer instance per parameter, stepped bucket by bucket.

    ``params``/``names`` are the parameters to optimize and their qualified
    names (used as ``state_dict`` keys). ``optim_cls(*args, **kwargs)`` is
    built once per parameter.
    """

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], optim_cls: type,
                 *args: Any, **kwargs: Any) -> None:
        if len(params) != len(names):
            raise ValueError(f"got {len(params)} parameters but {len(names)} names")
        # The optimizer class, for messages and the state_dict.
        self.optim_cls = optim_cls
        # Parameters this optimizer updates, in DDP's definition order.
        self.params = list(params)
        # Their qualified names: state_dict keys that survive a bucket rebuild and a restart.
        self.names = list(names)
        # id(param) -> its own optimizer (see [Note: fused optimizer] for why per parameter).
        self._by_id: dict[int, torch.optim.Optimizer] = {
            id(p): optim_cls([p], *args, **kwargs) for p in self.params
        }
        # Number of per-parameter steps taken, over the whole run (for tests and logs).
        self.param_steps = 0

    # ------------------------------------------------------------------ stepping
    def step_bucket(self, bucket: Bucket) -> None:
        """Step every parameter of ``bucket`` that has a gradient (the reducer's post_reduce)."""
        by_id = self._by_id
        for p in bucket.params:
            opt = by_id.get(id(p))
            if opt is not None and p.grad is not None:
                opt.step()
                self.param_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of every optimized parameter (like ``Optimizer.zero_grad``)."""
        for opt in self._by_id.values():
            opt.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ access
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-parameter optimizers, in the order of ``params``."""
        return [self._by_id[id(p)] for p in self.params]

    def optimizer_for(self, param: torch.Tensor) -> torch.optim.Optimizer:
        """The optimizer that updates ``param`` (e.g. to attach a scheduler or read state)."""
        opt = self._by_id.get(id(param))
        if opt is None:
            raise KeyError("this parameter is not updated by the fused optimizer "
                           "(not a trainable parameter of the DDP module, or left out "
                           "of optim_params)")
        return opt

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every per-parameter optimizer's param groups, so ``g["lr"] = ...`` reaches all."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def named_optimizers(self) -> Iterator[tuple[str, torch.optim.Optimizer]]:
        """(parameter name, its optimizer) pairs, in the order of ``params``."""
        return zip(self.names, self.optimizers)

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``{"optim_cls": name, "per_param": {param name: optimizer state_dict}}``."""
        return {
            "optim_cls": f"{self.optim_cls.__module__}.{self.optim_cls.__qualname__}",
            "per_param": {n: opt.state_dict() for n, opt in self.named_optimizers()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the parameter names must match exactly."""
        per_param = state.get("per_param")
        if not isinstance(per_param, dict):
            raise ValueError("not a FusedOptimizer state_dict: missing the 'per_param' dict")
        missing = [n for n in self.names if n not in per_param]
        unexpected = [n for n in per_param if n not in set(self.names)]
        if missing or unexpected:
            raise KeyError(f"fused optimizer state_dict does not match the model: "
                           f"missing {missing[:10]}, unexpected {unexpected[:10]}")
        for name, opt in self.named_optimizers():
            opt.load_state_dict(per_param[name])


def _select(params: list[torch.nn.Parameter], names: list[str],
            wanted: Iterable[torch.Tensor] | None,
            ) -> tuple[list[torch.nn.Parameter], list[str]]:
    """The subset ``wanted`` (torch's ``optim_params``), kept in DDP's order."""
    if wanted is None:
        return list(params), list(names)
    wanted = list(wanted)
    index = {id(p): i for i, p in enumerate(params)}
    strangers = [i for i, p in enumerate(wanted) if id(p) not in index]
    if strangers:
        raise ValueError(f"optim_params[{strangers[0]}] is not a trainable parameter of the "
                         "DDP module; a fused optimizer can only update those")
    chosen = sorted({index[id(p)] for p in wanted})
    if not chosen:
        raise ValueError("optim_params is empty: the fused optimizer would update nothing")
    return [params[i] for i in chosen], [names[i] for i in chosen]


def attach_fused_optimizer(reducer: Any, optim_cls: type, *args: Any,
                           optim_params: Iterable[torch.Tensor] | None = None,
                           **kwargs: Any) -> FusedOptimizer:
    """Build a ``FusedOptimizer`` over the reducer's parameters and hook it into finalize.

    ``optim_params`` (as in torch) restricts it to a subset of the parameters;
    the others keep their averaged gradients for a separate optimizer. Whether
    the reducer's buckets are free for it is the DDP's ConsumerSlot's to decide
    ([Note: one consumer] in ``gradring/ddp/consumers.py``).
    """
    if not isinstance(optim_cls, type) or not issubclass(optim_cls, torch.optim.Optimizer):
        raise TypeError(f"optim_cls must be a torch.optim.Optimizer subclass (e.g. "
                        f"torch.optim.SGD), got {optim_cls!r}")
    if optim_cls is torch.optim.LBFGS:
        raise ValueError("LBFGS needs a closure and couples all parameters; it cannot be "
                         "stepped per parameter inside backward")
    params, names = _select(reducer.params, reducer.names, optim_params)
    fused = FusedOptimizer(params, names, optim_cls, *args, **kwargs)
    reducer.set_post_reduce(fused.step_bucket)
    return fused
