"""no_sync against torch's DDP: accumulation with find_unused_parameters when the
used parameters differ by rank and micro-batch, and the error after an unused
parameter's unfinished reduction naming the unused parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.irregular_models import compare_grads
from tests.support.side_by_side import IMPLS, _grads


class _RankBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool, use_c: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = h + self.b(h)
        if use_c:
            h = h * torch.sigmoid(self.c(h))
        return self.head(h)


def _no_sync_rank_flow(rank, world_size, accumulate):
    torch.manual_seed(0)
    base = _RankBranch().double()
    out = {}
    for name, cls in IMPLS.items():
        ddp = cls(copy.deepcopy(base), find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        steps = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            for micro in range(accumulate):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x = torch.randn(3, 4, generator=g, dtype=torch.float64)
                use_b = (rank + micro) % 2 == 0          # differs between ranks
                use_c = rank == world_size - 1 and step != 1
                ctx = ddp.no_sync() if micro < accumulate - 1 else _nullcontext()
                with ctx:
                    ddp(x, use_b, use_c).pow(2).mean().backward()
            steps.append(_grads(ddp.module))
            opt.step()
        out[name] = steps
    return out


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_with_find_unused_and_rank_dependent_flow(pools, world_size):
    for r in pools.run(world_size, _no_sync_rank_flow, 3):
        assert compare_grads(r["gradring"], r["torch"], tol=1e-12) is None


def _unused_then_no_sync(rank, world_size):
    out = {}
    for name, cls in IMPLS.items():
        torch.manual_seed(0)
        module = nn.ModuleDict({"used": nn.Linear(3, 3), "idle": nn.Linear(3, 3)})
        module.forward = lambda x, m=module: m["used"](x)
        ddp = cls(module)
        x = torch.randn(2, 3)
        ddp(x).sum().backward()
        try:
            with ddp.no_sync():
                ddp(x).sum().backward()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    return out


def test_unused_parameter_then_no_sync_names_the_unused(pools):
    for r in pools.run(2, _unused_then_no_sync):
        head = "Expected to have finished reduction in the prior iteration"
        assert head in r["torch"] and head in r["gradring"]
        assert "idle.weight" in r["gradring"] and "idle.bias" in r["gradring"]
        assert "used.weight" not in r["gradring"] and "used.bias" not in r["gradring"]
