"""The tuner's workloads: small models with an input and a loss, built by name.

A workload is a function returning ``(model, input, loss_fn)``;
``loss_fn(output)`` gives the scalar to call ``backward()`` on. ``gradring
tune`` and ``gradring plan`` take a built-in name from ``BUILTIN``, a
``module:function`` spec, or a callable (``load_workload``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Workload = tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]


def mlp(batch: int = 32) -> Workload:
    """12 x Linear(1024, 1024): 48 MiB of gradients in equal 4 MiB layers, batch 32."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(batch, 1024), lambda out: out.pow(2).mean()


def mlp_b1() -> Workload:
    """``mlp`` at batch 1: a backward about as short as its 48 MiB all-reduce."""
    return mlp(1)


def wide_mlp() -> Workload:
    """4 x Linear(2048, 2048) at batch 8: 64 MiB of gradients, little compute per byte."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(8, 2048), lambda out: out.pow(2).mean()


def deep_mlp() -> Workload:
    """48 x Linear(512, 512) at batch 8: 48 MiB of gradients in 1 MiB layers, a short backward."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(48):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(8, 512), lambda out: out.pow(2).mean()


def tiny() -> Workload:
    """4 x Linear(256, 256): for tests (1 MiB of gradients)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers), torch.randn(16, 256), lambda out: out.pow(2).mean()


BUILTIN: dict[str, Callable[[], Workload]] = {
    "mlp": mlp, "mlp_b1": mlp_b1, "wide_mlp": wide_mlp, "deep_mlp": deep_mlp, "tiny": tiny}


def from_parts(model_fn: Callable[[], nn.Module], input_fn: Callable[[], Any],
                loss_fn: Callable[[Any], torch.Tensor]) -> Workload:
    """A workload from three module-level functions (picklable by name, unlike a lambda)."""
    return model_fn(), input_fn(), loss_fn


def load_workload(spec: str | Callable[[], Workload]) -> Workload:
    """A built-in name, ``module:function`` or a callable, each giving (model, input, loss_fn)."""
    if callable(spec):
        return spec()
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise ValueError(f"unknown workload {spec!r}: use one of {sorted(BUILTIN)} "
                         "or module:function")
    mod, _, fn = spec.partition(":")
    return getattr(importlib.import_module(mod), fn)()


def forward_loss(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor]) -> Any:
    """The loss of one forward; a tuple input is unpacked into the model's arguments."""
    out = model(*x) if isinstance(x, tuple) else model(x)
    return loss_fn(out)
