"""Ring collectives over any point-to-point transport (Gloo's allreduce_ring).

Rank ``r`` sends to ``r+1`` and receives from ``r-1``; the buffer is cut into
``W`` chunks (:func:`ops.chunk_bounds`). Reduce-scatter: in round ``s`` rank
``r`` sends chunk ``r-s-1`` and receives and combines chunk ``r-s-2``, so after
``W-1`` rounds it holds chunk ``r`` reduced; all-gather: in round ``s`` it sends
chunk ``r-s`` and receives chunk ``r-s-1`` in place. Each rank sends ``2(W-1)/W``
of the buffer (bandwidth-optimal), and every chunk is reduced by one chain and
then copied, so all ranks end with identical bits. A chunk travels as
*pieces*, all posted before any is waited on, so piece ``k`` is reduced while
``k+1`` is in flight ([Note: requests progress in wait_all]).
"""

from __future__ import annotations

from typing import Any

import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import Transport

#: Pipeline granularity of one round. Small enough that reduce overlaps
#: transfer, large enough that per-message overhead stays negligible.
PIECE_BYTES = 512 * 1024


def _post_round(t: Transport, send: torch.Tensor, recv: torch.Tensor,
                op: Op | None) -> list[Any]:
    """Post one ring round: ``send`` goes right, ``recv`` comes from the left."""
    w, r = t.world_size, t.rank
    step = max(1, PIECE_BYTES // max(1, send.element_size()))
    reqs = [t.irecv(recv[lo:hi], (r - 1) % w, op) for lo, hi in ops.pieces(0, recv.numel(), step)]
    reqs += [t.isend(send[lo:hi], (r + 1) % w) for lo, hi in ops.pieces(0, send.numel(), step)]
    return reqs


def reduce_scatter_inplace(t: Transport, flat: torch.Tensor, op: Op,
                           bounds: list[tuple[int, int]]) -> None:
    """Leave chunk ``t.rank`` of ``flat`` fully reduced (other chunks: partial sums)."""
    w, r = t.world_size, t.rank
    for s in range(w - 1):
        slo, shi = bounds[(r - s - 1) % w]
        rlo, rhi = bounds[(r - s - 2) % w]
        t.wait_all(_post_round(t, flat[slo:shi], flat[rlo:rhi], op))


def all_gather_inplace(t: Transport, flat: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
    """Given chunk ``t.rank`` of ``flat`` on every rank, fill in all other chunks."""
    w, r = t.world_size, t.rank
    for s in range(w - 1):
        slo, shi = bounds[(r - s) % w]
        rlo, rhi = bounds[(r - s - 1) % w]
        t.wait_all(_post_round(t, flat[slo:shi], flat[rlo:rhi], None))


def all_reduce(t: Transport, flat: torch.Tensor, op: Op) -> None:
    """Ring all-reduce of ``flat`` in place: reduce-scatter, finish own chunk, all-gather."""
    bounds = ops.chunk_bounds(flat.numel(), t.world_size)
    reduce_scatter_inplace(t, flat, op, bounds)
    lo, hi = bounds[t.rank]
    ops.finish(flat[lo:hi], op, t.world_size)
    all_gather_inplace(t, flat, bounds)


def reduce_scatter(t: Transport, out: torch.Tensor, inp: torch.Tensor, op: Op) -> None:
    """``out`` = chunk ``rank`` of the reduction of every rank's ``inp``; ``inp`` is unchanged.

    Partial sums travel through two scratch chunks (one being sent while the
    next is received); the last round receives straight into ``out``.
    """
    w, r, m = t.world_size, t.rank, out.numel()
    chunk = lambda c: inp[c * m:(c + 1) * m]
    scratch = [torch.empty_like(out), torch.empty_like(out)] if w > 2 else []
    if w == 1 and out.data_ptr() != inp.data_ptr():
        ops.copy(out, inp)
    sending = chunk((r - 1) % w)
    for s in range(w - 1):
        acc = out if s == w - 2 else scratch[s % 2]
        mine = chunk((r - s - 2) % w)
        if acc.data_ptr() != mine.data_ptr():  # out may alias inp's chunk r
            ops.copy(acc, mine)
        t.wait_all(_post_round(t, sending, acc, op))
        sending = acc
    ops.finish(out, op, w)


def all_gather(t: Transport, out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` = every rank's ``inp`` concatenated in rank order."""
    m = inp.numel()
    bounds = [(c * m, (c + 1) * m) for c in range(t.world_size)]
    mine = out[bounds[t.rank][0]:bounds[t.rank][1]]
    if mine.data_ptr() != inp.data_ptr():
        ops.copy(mine, inp)
    all_gather_inplace(t, out, bounds)
