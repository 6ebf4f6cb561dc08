"""The naive all-reduce: everybody gets everything, then reduces in rank order.

A correctness reference for the transports (the tests' closed-form oracles over
all ranks' data at once are ``tests/support/comm_oracle.py``).
"""

from __future__ import annotations

import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import Transport


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
