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
   group's point-to-point (:class:`SubsetTransport`);
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

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm import ops, select
from gradring.comm.algos import ring, tree
from gradring.comm.ops import Op
from gradring.comm.transport import (
    CollectiveError,
    CollectiveInfo,
    DirectTransport,
    Kind,
    Transport,
)
from gradring.comm.transports.shm import rendezvous
from gradring.comm.transports.topology import Topology, exchange


class SubsetTransport:
    """Point-to-point among some of a transport's ranks, addressed by index in ``ranks``.

    The inter-host step talks to the same-local-rank peers through the whole
    group's transport (the process group's send/recv), so no sub-process-group
    has to be created collectively; messages between a pair stay in order.
    """

    name = "subset"

    def __init__(self, inner: Transport, ranks: Sequence[int]) -> None:
        # The transport that moves the bytes (group ranks).
        self.inner = inner
        # Group rank of each member; index = rank within the subset.
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(inner.rank)
        self.world_size = len(self.ranks)

    def start(self, info: CollectiveInfo) -> None:
        self.inner.start(info)

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        return self.inner.isend(buf, self.ranks[dst])

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        return self.inner.irecv(buf, self.ranks[src], op)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        self.inner.wait_all(reqs)

    def close(self) -> None:
        """The inner transport belongs to whoever made it."""


class HostTransports:
    """The transports of a multi-host group: shm inside the host, p2p across.

    It is itself a point-to-point transport over the whole group (delegating
    to ``flat``), so ring, tree and broadcast still run on it unchanged.
    """

    name = "shm+torch"

    def __init__(self, topology: Topology, local: DirectTransport, flat: Transport) -> None:
        # Which ranks share a host; fixed for the group's lifetime.
        self.topology = topology
        # Shared memory among this host's ranks (local ranks 0..L-1).
        self.local = local
        # Point-to-point over the whole group (the process group's send/recv).
        self.flat = flat
        # The same, restricted to this rank's same-local-rank peer on every host.
        self.inter = SubsetTransport(flat, topology.peers)
        self.rank = flat.rank
        self.world_size = flat.world_size

    def start(self, info: CollectiveInfo) -> None:
        self.flat.start(info)
        self.local.start(info)

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        return self.flat.isend(buf, dst)

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        return self.flat.irecv(buf, src, op)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        self.flat.wait_all(reqs)

    def close(self) -> None:
        """Close the host's shared memory; ``flat`` belongs to the group context."""
        self.local.close()

    def local_error(self, exc: CollectiveError) -> CollectiveError:
        """``exc`` (naming local ranks) with this host's local-to-group rank map."""
        topo = self.topology
        legend = ", ".join(f"local {i} = rank {r}" for i, r in enumerate(topo.local_ranks))
        name = topo.names[topo.host_index] if topo.names else f"host{topo.host_index}"
        return CollectiveError(f"{exc} [ranks above are local to host {name!r}: {legend}]")


def _copy_except(dst: torch.Tensor, src: torch.Tensor, lo: int, hi: int) -> None:
    """Stage ``src`` into ``dst`` except ``[lo, hi)``, which this rank reduces from ``src``."""
    ops.copy(dst[:lo], src[:lo])
    ops.copy(dst[hi:], src[hi:])


def _inter_all_reduce(t: Transport, shard: torch.Tensor, op: Op) -> None:
    """All-reduce ``shard`` across hosts (SUM for AVG: the caller divides by W)."""
    nbytes = shard.numel() * shard.element_size()
    algo = select.choose(Kind.ALL_REDUCE, nbytes, t.world_size, "torch", None).algo
    (tree.all_reduce if algo == "tree" else ring.all_reduce)(t, shard, op)


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


def connect(store: Any, rank: int, world_size: int, timeout: float,
            flat: Transport) -> tuple[HostTransports | None, str]:
    """Learn the topology and connect each host's shared memory; collective.

    Returns ``(transports, "")`` when the group spans several hosts with the
    same number (> 1) of ranks each and every host's shared memory connected,
    else ``(None, reason)``. Every rank reaches the same verdict: the last
    round agrees on the shm outcome of all hosts.
    """
    topo, prefix = exchange(store, rank, world_size, timeout)
    if topo.num_hosts == 1:
        return None, "all ranks are on one host"
    if not topo.uniform:
        return None, (f"hosts have different numbers of ranks "
                      f"({[len(h) for h in topo.hosts]}): {topo.describe()}")
    if topo.local_size == 1:
        return None, f"one rank per host: {topo.describe()}"
    host_store = dist.PrefixStore(f"{prefix}host{topo.host_index}/", store)
    local, why = rendezvous.connect(host_store, topo.local_rank, topo.local_size, timeout)
    store.set(f"{prefix}shm/{rank}", json.dumps(why if local is None else ""))
    keys = [f"{prefix}shm/{p}" for p in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout))
    verdicts = [json.loads(store.get(k)) for k in keys]
    bad = [f"rank {p}: {v}" for p, v in enumerate(verdicts) if v]
    if bad:
        if local is not None:
            local.close()
        return None, "shared memory inside a host failed: " + "; ".join(bad)
    return HostTransports(topo, local, flat), ""  # type: ignore[arg-type]
