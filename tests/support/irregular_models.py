"""Models with irregular graphs, and a side-by-side runner against torch's DDP."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradring


class Branchy(nn.Module):
    """``skip`` is never used; ``b`` is used only when the batch mean is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.skip = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if x.mean() > 0:
            h = h + self.b(h)
        return self.head(h)


class TwoHeads(nn.Module):
    """Returns two outputs; ``head_b`` feeds only the second one."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.head_a = nn.Linear(6, 2)
        self.head_b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.head_a(h), self.head_b(h)


class MoE(nn.Module):
    """Top-1 routing to 4 experts: which experts run depends on this rank's data."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 4)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.gate(x), dim=-1)
        choice = scores.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = expert(x[mask]) * scores[mask, e:e + 1]
        return self.head(out)


class Checkpointed(nn.Module):
    """The same block run twice under reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(6, 6)  # makes the checkpoint's input require grad
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, self.pre(x), use_reentrant=True)
        h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


class Deep(nn.Module):
    """A chain deeper than Python's recursion limit, plus one unused layer."""

    def __init__(self, depth: int = 1500) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.unused = nn.Linear(4, 4)
        self.depth = depth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.depth):
            h = h * self.scale + 0.001
        return h


MODELS: dict[str, Callable[[], nn.Module]] = {
    "branchy": Branchy, "two_heads": TwoHeads, "moe": MoE, "checkpointed": Checkpointed,
    "deep": Deep,
}


def batch(rank: int, step: int, n: int = 4, dim: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, dim, generator=g, dtype=torch.float64)


def loss_fn(out: Any) -> torch.Tensor:
    if isinstance(out, tuple):
        return out[0].pow(2).mean()  # the second output is never used
    return out.pow(2).mean()


def run_side_by_side(rank: int, kind: str, kwargs: dict[str, Any], inputs: list[torch.Tensor],
                     *, torch_too: bool = True) -> dict[str, Any]:
    """Train gradring's and torch's DDP on the same inputs; report grads and errors."""
    torch.manual_seed(0)
    base = MODELS[kind]().double()
    results: dict[str, Any] = {}
    impls = [("gradring", gradring.DistributedDataParallel)]
    if torch_too:
        impls.append(("torch", torch.nn.parallel.DistributedDataParallel))
    for name, cls in impls:
        model = cls(copy.deepcopy(base), **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps: list[list[Any]] = []
        error = None
        try:
            for x in inputs:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(x)).backward()
                steps.append([None if p.grad is None else p.grad.clone()
                              for p in model.module.parameters()])
                opt.step()
        except RuntimeError as e:
            error = str(e)
        results[name] = {"grads": steps, "error": error,
                         "logging": _logging(model) if name == "gradring" else None}
    return results


def _logging(model: Any) -> dict[str, Any]:
    return model._get_ddp_logging_data()


def compare_grads(a: list[list[Any]], b: list[list[Any]], tol: float = 1e-10) -> str | None:
    """None when equal; otherwise a description of the first difference."""
    if len(a) != len(b):
        return f"{len(a)} steps vs {len(b)}"
    for s, (ga, gb) in enumerate(zip(a, b)):
        for i, (x, y) in enumerate(zip(ga, gb)):
            if (x is None) != (y is None):
                return f"step {s} param {i}: None-ness differs ({x is None} vs {y is None})"
            if x is not None and (x - y).abs().max().item() > tol:
                return f"step {s} param {i}: max diff {(x - y).abs().max().item():.3g}"
    return None
