"""Hierarchical all-reduce for groups spanning several hosts with several ranks each.

[Note: hierarchical all-reduce]
With H hosts of L ranks each, the bytes that cross the slow links are what
matters. A flat ring over all W = H·L ranks crosses a host boundary in H of
its W hops and runs 2(W-1) dependent steps; each host link carries
2(W-1)/W of the buffer per direction. The hierarchical all-reduce:

1. intra-host reduce-scatter over shared memory: local rank ``l`` reduces
   chunk ``l`` (``ops.chunk_bounds(n, L)``) of all local ranks' buffers into
   its exposed buffer (the first half of ``direct.all_reduce_twoshot``);
2. inter-host all-reduce of that chunk among the ranks with local rank ``l``
   on every host (ring, or tree for small chunks, as ``select`` decides) --
   L such all-reduces run at once, one per local rank, over the process
   group's point-to-point (``SubsetTransport`` in ``transports/hosts.py``);
3. intra-host all-gather: a barrier, then every rank copies the other chunks
   from their owners' exposed buffers (here the owners cannot write them into
   the peers, as the two-shot does: their shard is only final after step 2).

Each host link now carries 2(H-1)/H of the buffer (at W=4 as 2×2: 1.0
against 1.5 for the flat ring) in 2(H-1) inter-host steps instead of 2(W-1).
Every chunk has one reducer per host and the inter-host algorithm gives its
participants identical bits, so all ranks end with identical bits. AVG sums
everywhere and divides once, by W, after step 2.

Errors from the shared-memory phases name *local* ranks; they are re-raised
with the local-to-group rank map of the host appended.
"""

from __future__ import annotations

import torch

from gradring.comm import ops, select
from gradring.comm.algos import ring, tree
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, CollectiveInfo, Kind, Transport
from gradring.comm.transports.hosts import HostTransports


def _copy_except(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """Stage ``src`` into ``dst`` except ``[lo, hi)``, which this rank reduces from ``src``."""
    ops.copy(dst[:lo], src[:lo])
    ops.copy(dst[hi:], src[hi:])


#: The all-reduces ``select.choose`` picks over point-to-point, by name. Called directly:
#: the table in ``algos/__init__`` lists this module, so it cannot be used from here.
_INTER = {"ring": ring.all_reduce, "tree": tree.all_reduce}


def _inter_all_reduce(t: Transport, shard: torch.Tensor, op: Op) -> None:
    """All-reduce ``shard`` across hosts (SUM for AVG: the caller divides by W)."""
    nbytes = shard.numel() * shard.element_size()
    algo = select.choose(Kind.ALL_REDUCE, nbytes, t.world_size, "torch", None).algo
    _INTER[algo](t, shard, op)


def all_reduce(h: HostTransports, info: CollectiveInfo, flat: torch.Tensor, op: Op) -> None:
    """Hierarchical all-reduce of ``flat`` in place; see [Note: hierarchical all-reduce].

    ``h`` is a :class:`HostTransports`: ``local`` (direct transport over the
    host's ranks: shm, or threads in the unit tests), ``inter`` (point-to-point
    among same-local-rank peers, one per host), ``world_size`` (all ranks).
    """
    local = h.local
    n_local, r = local.world_size, local.rank
    bounds = ops.chunk_bounds(flat.numel(), n_local)
    lo, hi = bounds[r]
    others = [p for p in range(n_local) if p != r]
    inter_op = ops.SUM if op.divides else op
    try:
        mine, zero_copy = local.expose(flat)
        if not zero_copy:
            _copy_except(mine, flat, lo, hi)
        ex = local.exchange(info, mine, zero_copy=zero_copy)
        views: list[torch.Tensor] = ex.views  # type: ignore[assignment] # all exposed
        shard = mine[lo:hi]
        ops.reduce_into(shard, [flat[lo:hi]] + [views[p][lo:hi] for p in others], inter_op)
    except CollectiveError as exc:
        raise h.local_error(exc) from exc
    _inter_all_reduce(h.inter, shard, inter_op)
    ops.finish(shard, op, h.world_size)
    try:
        local.arrive()
        if not zero_copy:
            ops.copy(flat[lo:hi], shard)  # overlaps the peers' arrival
        local.wait_arrivals()
        for p in others:
            plo, phi = bounds[p]
            ops.copy(flat[plo:phi], views[p][plo:phi])
        if ex.zero_copy:
            local.barrier()
    except CollectiveError as exc:
        raise h.local_error(exc) from exc
