"""Helpers for rank bodies that run gradring's DDP and torch's own DDP side by side.

A rank body trains both on the same seeds and inputs in the same rank processes
and returns both results; the test compares them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gradring

# The two implementations, under the names the rank bodies give their results.
IMPLS = {"gradring": gradring.DistributedDataParallel,
         "torch": torch.nn.parallel.DistributedDataParallel}
TORCH_DDP = torch.nn.parallel.DistributedDataParallel
BOTH = (("theirs", TORCH_DDP), ("ours", gradring.DistributedDataParallel))


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _same_everywhere(t: torch.Tensor) -> bool:
    """Whether every rank holds the same values of ``t``."""
    flat = t.detach().reshape(-1).double()
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Net(nn.Module):
    def __init__(self, rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(rank)  # rank-dependent: what init sync does shows
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3)
        self.register_buffer("count", torch.full((2,), float(rank)))
        self.register_buffer("local", torch.full((1,), float(rank)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.fc2(torch.relu(self.fc1(x)))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank),
                       dtype=torch.float64)


def _train(ddp: nn.Module, rank: int, steps: int = 3) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        ddp(_batch(s, rank)).pow(2).mean().backward()
        opt.step()


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out.update({f"grad:{n}": p.grad.clone() for n, p in m.named_parameters()
                if p.grad is not None})
    return out


def _equal(a: dict, b: dict, world: int = 2) -> list[str]:
    """Keys whose tensors differ: bit for bit at world 2; at world 3 and more
    the ring sums in another order than gloo, so float64 within 1e-12."""
    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        if world <= 2 or not x.is_floating_point():
            return torch.equal(x, y)
        return x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=1e-12)
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not same(a[k], b[k]))


class _Nested(nn.Module):
    """Returns its outputs nested as a tuple, a list and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.x = nn.Linear(6, 2)
        self.y = nn.Linear(6, 3)
        self.z = nn.Linear(6, 1)

    def forward(self, inp: torch.Tensor):
        h = torch.tanh(self.trunk(inp))
        return (self.x(h), [self.y(h), {"z": self.z(h), "h": h}])
