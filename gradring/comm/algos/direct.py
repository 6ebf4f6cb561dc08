"""Collectives for transports whose ranks read each other's memory (shm, the tests' threads).

[Note: direct algorithms]
Every rank *exposes* one buffer and *exchanges* descriptors (one barrier);
afterwards it reads and writes peers' buffers in place. No bytes are sent: the
only traffic is the reduction's own memory traffic (docs/collectives.md).

- ``all_reduce_twoshot`` (large) = reduce-scatter by direct reads + all-gather
  by direct writes: rank ``r`` reduces chunk ``r`` of every rank's buffer (own
  data first, in place) and writes the result into chunk ``r`` of every peer's
  buffer, the very bytes it just read, which only that chunk's reducer touches;
- ``all_reduce_oneshot`` (mid-sized): every rank reduces the whole buffer from
  all ranks' staging copies, in rank order, so all compute identical bits;
- ``all_reduce_inline`` (small): the one-shot with the inputs carried in the
  exchange itself ([Note: inline exchange] in ``transports/shm/transport.py``).

The shm transport ends every collective that did data work after its last
barrier with one more (``ShmTransport.finish``, the closing agreement: [Note:
sticky failures]). A user tensor is staged (two alternating staging sets); a
``comm.empty`` tensor is exposed as is, and peers read it after we may return,
so the algorithms end with a barrier where zero-copy memory was exposed, which
then serves as that agreement (the two-shot's second barrier is its own).
"""

from __future__ import annotations

import torch

from gradring.comm import ops
from gradring.comm.external import ExternalParts, reduce_own, spans
from gradring.comm.ops import Op
from gradring.comm.transport import Collective, DirectTransport


def _staged_copy_except(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """Copy ``src`` into ``dst`` except ``[lo, hi)`` (the part this rank reads itself)."""
    if lo > 0:
        ops.copy(dst[:lo], src[:lo])
    if hi < src.numel():
        ops.copy(dst[hi:], src[hi:])


def _still_agreed(t: DirectTransport) -> None:
    """Raise if some rank already failed this group (shm: its sticky verdict)."""
    check = getattr(t, "check_verdict", None)
    if check is not None:
        check()


def all_reduce_twoshot(t: DirectTransport, info: Collective, flat: torch.Tensor,
                       op: Op, parts: ExternalParts | None = None) -> None:
    """Reduce-scatter through direct reads, all-gather through direct writes; see
    [Note: direct algorithms]. With ``parts`` (SUM only), see [Note: external
    parts] in ``external.py``.

    [Note: whole chunks, not pipelined blocks]
    Blocks signalled one by one, so that peers copy a block while it is still in
    the shared cache, measured 1.4-1.9x *slower* (4 and 25 MiB, world 2): reading
    lines another core has just dirtied costs more than reading them from DRAM.
    """
    w, r = t.world_size, t.rank
    bounds = ops.chunk_bounds(flat.numel(), w)
    lo, hi = bounds[r]
    mine, zero_copy = t.expose(flat)
    if not zero_copy:
        _staged_copy_except(mine, flat, lo, hi)
    ex = t.exchange(info, mine, zero_copy=zero_copy)
    views: list[torch.Tensor] = ex.views  # type: ignore[assignment] # all ranks exposed
    # Reduce chunk r, own data first so the output may alias it (every chunk
    # has one reducer, so all ranks still end with the same bits), then write
    # it into every peer's exposed buffer.
    peers = [views[p] for p in range(w) if p != r]
    _still_agreed(t)  # no writes into peers' memory once any rank gave up
    if parts is None:
        # In place into our own tensor (its lines are in cache: they were just
        # read): measured 5-15% faster at 4-25 MiB than summing into staging.
        dst = flat[lo:hi]
        ops.reduce_into(dst, [dst] + [v[lo:hi] for v in peers], op)
        ops.finish(dst, op, w)
        for v in peers:
            ops.copy(v[lo:hi], dst)
    else:
        reduce_own(flat, peers, parts, lo, hi)
    t.arrive()
    t.wait_arrivals()
    # Every other chunk's result now sits in our exposed buffer: where that is
    # not its destination (staging, or an external part), move it there.
    for p in range(w):
        if p != r:
            for a, b, part in spans(parts, *bounds[p]):
                if part is not None:
                    ops.copy(part, mine[a:b])
                elif not zero_copy:
                    ops.copy(flat[a:b], mine[a:b])


def all_reduce_oneshot(t: DirectTransport, info: Collective, flat: torch.Tensor,
                       op: Op) -> None:
    """Every rank reduces everything from staged copies: one barrier, for small messages."""
    mine, _ = t.expose(flat, force_staging=True)
    ops.copy(mine, flat)
    ex = t.exchange(info, mine, zero_copy=False)
    ops.reduce_into(flat, [v for v in ex.views if v is not None], op)
    ops.finish(flat, op, t.world_size)


def all_reduce_inline(t: DirectTransport, info: Collective, flat: torch.Tensor,
                      op: Op) -> None:
    """Small messages: the one-shot with every input carried by the exchange itself
    (``exchange_inline``), so one barrier and no closing agreement; the same sum in
    the same rank order as :func:`all_reduce_oneshot`, so the same bits. ``flat`` may
    be any contiguous tensor (the small synchronous path passes the caller's)."""
    ops.reduce_into(flat, t.exchange_inline(info, flat), op)
    ops.finish(flat, op, t.world_size)


def broadcast(t: DirectTransport, info: Collective, flat: torch.Tensor, src: int) -> None:
    """Group rank ``src`` exposes its buffer; everybody else copies it."""
    exposed = None
    zero_copy = False
    if t.rank == src:
        exposed, zero_copy = t.expose(flat)
        if not zero_copy:
            ops.copy(exposed, flat)
    ex = t.exchange(info, exposed, zero_copy=zero_copy)
    if t.rank != src:
        view = ex.views[src]
        assert view is not None
        ops.copy(flat, view)
    if ex.zero_copy:
        t.barrier()


def all_gather(t: DirectTransport, info: Collective, out: torch.Tensor,
               inp: torch.Tensor) -> None:
    """``out`` = every rank's ``inp`` in rank order, each copied from its owner."""
    m = inp.numel()
    exposed, zero_copy = t.expose(inp)
    if not zero_copy:
        ops.copy(exposed, inp)
    ex = t.exchange(info, exposed, zero_copy=zero_copy)
    for p, view in enumerate(ex.views):
        dst = out[p * m:(p + 1) * m]
        src = inp if p == t.rank else view
        assert src is not None
        if dst.data_ptr() != src.data_ptr():
            ops.copy(dst, src)
    if ex.zero_copy:
        t.barrier()


def reduce_scatter(t: DirectTransport, info: Collective, out: torch.Tensor,
                   inp: torch.Tensor, op: Op) -> None:
    """``out`` = chunk ``rank`` of the reduction, read directly from every rank's ``inp``."""
    w, r, m = t.world_size, t.rank, out.numel()
    lo, hi = r * m, (r + 1) * m
    exposed, zero_copy = t.expose(inp)
    if not zero_copy:
        _staged_copy_except(exposed, inp, lo, hi)
    ex = t.exchange(info, exposed, zero_copy=zero_copy)
    order = [r] + [p for p in range(w) if p != r]
    srcs = [inp[lo:hi]] + [ex.views[p][lo:hi] for p in order[1:]]  # type: ignore[index]
    ops.reduce_into(out, srcs, op)
    ops.finish(out, op, w)
    if ex.zero_copy:
        t.barrier()


def barrier(t: DirectTransport, info: Collective) -> None:
    """One shared-memory barrier (with the descriptor check that names stragglers)."""
    t.exchange(info, None, zero_copy=False)
