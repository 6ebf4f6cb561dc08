"""The naive collectives: the oracle the tests compare every other algorithm with.

Two forms of the same idea, "everybody gets everything, then reduces in rank
order":

- functions over *all ranks' data at once* (``oracle_*``), used by tests as
  closed-form expected values;
- :func:`all_reduce`, the same thing over a point-to-point transport, which
  is also a correctness reference for the transports themselves.
"""

from __future__ import annotations

import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import Transport


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


def all_reduce(t: Transport, flat: torch.Tensor, op: Op) -> None:
    """Send the whole buffer to every peer, reduce everything locally in rank order."""
    w, r = t.world_size, t.rank
    if w == 1 or flat.numel() == 0:
        ops.finish(flat, op, w)
        return
    bufs: list[torch.Tensor] = [torch.empty_like(flat) for _ in range(w)]
    ops.copy(bufs[r], flat)
    reqs = [t.irecv(bufs[p], p) for p in range(w) if p != r]
    reqs += [t.isend(bufs[r], p) for p in range(w) if p != r]
    t.wait_all(reqs)
    ops.reduce_into(flat, bufs, op)
    ops.finish(flat, op, w)
