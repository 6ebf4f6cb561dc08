"""Optimizer fused into backward (SPEC S13): each bucket's parameters step as
soon as that bucket's reduced gradients are written, while later buckets may
still be in flight."""

from __future__ import annotations

from typing import Any

import torch

from gradring.buckets import Bucket


class FusedOptimizer:
    """One optimizer instance per parameter, stepped bucket by bucket."""

    def __init__(self, params: list[torch.nn.Parameter], optim_cls: type,
                 *args: Any, **kwargs: Any) -> None:
        # Per-parameter optimizers: buckets are rebuilt, parameters are not.
        self.optimizers = {id(p): optim_cls([p], *args, **kwargs) for p in params}

    def step_bucket(self, bucket: Bucket) -> None:
        for p in bucket.params:
            if p.grad is not None:
                self.optimizers[id(p)].step()


def attach_fused_optimizer(reducer: Any, optim_cls: type, *args: Any,
                           **kwargs: Any) -> FusedOptimizer:
    if not isinstance(optim_cls, type) or not issubclass(optim_cls, torch.optim.Optimizer):
        raise TypeError(f"optim_cls must be a torch.optim.Optimizer subclass, got {optim_cls!r}")
    fused = FusedOptimizer(reducer.params, optim_cls, *args, **kwargs)
    reducer.post_reduce = fused.step_bucket
    return fused
