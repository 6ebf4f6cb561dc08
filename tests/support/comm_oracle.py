"""Closed-form collectives over all ranks' data at once: what every algorithm and
transport must compute ("everybody gets everything, then reduces in rank order",
as ``gradring/comm/algos/naive.py`` does over a transport)."""

from __future__ import annotations

import torch

from gradring.comm import ops
from gradring.comm.ops import Op


def oracle_all_reduce(inputs: list[torch.Tensor], op: Op) -> torch.Tensor:
    """``inputs[0] (op) inputs[1] (op) ...`` in rank order, then AVG's division."""
    out = inputs[0].clone()
    for x in inputs[1:]:
        ops.combine(out, out, x, op)
    ops.finish(out, op, len(inputs))
    return out


def oracle_reduce_scatter(inputs: list[torch.Tensor], op: Op) -> list[torch.Tensor]:
    """Rank ``r`` gets chunk ``r`` of the reduction (input length = world × output length)."""
    total = oracle_all_reduce(inputs, op)
    return list(total.chunk(len(inputs))) if total.numel() else [total] * len(inputs)


def oracle_all_gather(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(inputs)
