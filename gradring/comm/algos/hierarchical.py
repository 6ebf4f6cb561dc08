"""Hierarchical all-reduce for groups spanning several hosts with several ranks each.

[Note: hierarchical all-reduce]
With H hosts of L ranks, the bytes on the slow links matter: a flat ring
carries 2(W-1)/W of the buffer per host link in 2(W-1) dependent steps. Here:
(1) an intra-host reduce-scatter over shared memory (local rank ``l`` reduces
chunk ``l``, the first half of ``direct.all_reduce_twoshot``); (2) L
inter-host all-reduces at once, of chunk ``l`` among the ranks with local rank
``l`` (ring or tree, as ``select`` decides, over ``SubsetTransport`` in
``transports/hosts.py``); (3) an intra-host all-gather: a barrier, then every
rank copies the other chunks from their owners (who cannot write them into
the peers, as the two-shot does: a shard is final only after step 2). A host
link then carries 2(H-1)/H of the buffer in 2(H-1) steps. Every chunk has one
reducer per host and the inter-host step gives identical bits, so all ranks
do; AVG divides once, by W, after step 2. Errors of the shared-memory phases
name local ranks, with the host's local-to-group map appended.

[Note: hierarchical closing agreement]
No rank may return success while another fails the collective ([Note: sticky
failures]); here the algorithm drives the host's shared memory itself, so per
host: the all-gather ends with a barrier (the closing agreement); the runner
passes every failure of this rank to ``HostTransports.mark_failed``, which
fails the host's shared memory, so host peers at that barrier stop and name
the cause; and ``finish`` passes to the shared memory. Across hosts, a rank
that fails or dies breaks its inter-host peers' send/recv (and posts on the
peer board).

[Note: a host without room in /dev/shm]
If a host's /dev/shm cannot hold a staging buffer, all its ranks raise
``ShmExhausted`` in the same collective, drop the host's shared memory
(``HostTransports.drop_local``) and run it again with the intra-host phases
over the process group (ring reduce-scatter and all-gather over the same
chunks). Local rank ``l`` still owns chunk ``l`` and sends the same inter-host
messages, so the other hosts run unchanged.
"""

from __future__ import annotations

import torch

from gradring.comm import ops, select
from gradring.comm.algos import ring, tree
from gradring.comm.ops import Op
from gradring.comm.transport import Collective, CollectiveError, Kind, Transport
from gradring.comm.transports.hosts import HostTransports
from gradring.comm.transports.shm.space import ShmExhausted


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


def all_reduce(h: HostTransports, info: Collective, flat: torch.Tensor, op: Op) -> None:
    """Hierarchical all-reduce of ``flat`` in place; see [Note: hierarchical all-reduce].
    ``h.local`` is the host's direct transport (None after its /dev/shm ran out),
    ``h.intra`` the host's point-to-point, ``h.inter`` the same-local-rank peers'."""
    if h.local is not None:
        try:
            _all_reduce_shared(h, info, flat, op)
            return
        except ShmExhausted as exc:  # the whole host, in this collective: see the Note
            h.drop_local(exc, _largest_holding(h))
    _all_reduce_p2p(h, flat, op)


def _largest_holding(h: HostTransports) -> int:
    """The most /dev/shm bytes any rank of this host holds, so that the host's ranks
    print one figure (see [Note: one figure, two causes] in ``shm/space.py``): one
    MAX all-reduce among them over point-to-point (all of them are here)."""
    mine = getattr(getattr(h.local, "memory", None), "reserved", 0)
    figures = torch.full((h.intra.world_size,), int(mine), dtype=torch.int64)
    ring.all_reduce(h.intra, figures, Op("MAX"))
    return int(figures.max())


def _all_reduce_p2p(h: HostTransports, flat: torch.Tensor, op: Op) -> None:
    """The same chunks and inter-host step, with the intra-host phases over
    point-to-point (see [Note: a host without room in /dev/shm])."""
    intra = h.intra
    bounds = ops.chunk_bounds(flat.numel(), intra.world_size)
    lo, hi = bounds[intra.rank]
    inter_op = ops.SUM if op.divides else op
    ring.reduce_scatter_inplace(intra, flat, inter_op, bounds)
    shard = flat[lo:hi]
    _inter_all_reduce(h.inter, shard, inter_op)
    ops.finish(shard, op, h.world_size)
    ring.all_gather_inplace(intra, flat, bounds)


def _all_reduce_shared(h: HostTransports, info: Collective, flat: torch.Tensor,
                       op: Op) -> None:
    """The intra-host phases over the host's shared memory; ``flat`` is untouched
    when ``ShmExhausted`` is raised (only the staging copy was written)."""
    local = h.local
    assert local is not None
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
    except ShmExhausted:
        raise  # every rank of the host raised it: all_reduce falls back
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
        # The closing agreement (see [Note: hierarchical closing agreement]); with a
        # zero-copy buffer also what keeps owners from changing it while peers read.
        local.barrier()
    except CollectiveError as exc:
        raise h.local_error(exc) from exc
