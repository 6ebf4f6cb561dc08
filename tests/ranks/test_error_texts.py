"""Error texts on real ranks: the model-mismatch error names each of the two
ranks that differ once, and both it and the unused-parameter error end with
what to change."""

from __future__ import annotations

import torch
from torch import nn

import gradring
from gradring import errors

# ---------------------------------------------------------------- rank bodies


def _different_models(rank: int, world_size: int) -> str:
    """Rank 0 builds a 64-wide first layer, rank 1 a 32-wide one."""
    width = 64 if rank == 0 else 32
    try:
        gradring.DistributedDataParallel(
            nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4)))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_param(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    ddp = gradring.DistributedDataParallel(_HalfUsed())
    try:
        for _ in range(3):
            ddp(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


# ---------------------------------------------------------------- tests


def test_shape_mismatch_names_each_rank_once(pools) -> None:
    msgs = pools.run(2, _different_models)
    zero, one = msgs
    # torch's sentence first, as people search for it.
    assert "params[0] in process 1 with sizes [32, 16] appears not to match" in zero, zero
    assert "params[0] in this process with sizes [32, 16] appears not to match" in one, one
    # Each message names this process, then the other rank: never the same rank twice.
    assert "this process (rank 0) has sizes [64, 16], rank 1 has [32, 16].)" in zero, zero
    assert "rank 0 has" not in zero, zero
    assert "this process (rank 1) has sizes [32, 16], rank 0 has [64, 16].)" in one, one
    assert "rank 1 has" not in one, one
    for m in msgs:
        assert m.endswith(errors.SAME_MODEL), m
        assert "build the model the same way on every rank" in m


def test_unused_parameter_error_ends_with_the_fix(pools) -> None:
    for m in pools.run(2, _unused_param):
        assert "Expected to have finished reduction in the prior iteration" in m, m
        last = m.splitlines()[-1]
        assert last.startswith("To fix: pass find_unused_parameters=True"), m
        assert "build the model and its forward's branches the same way on every rank" in last

