"""The transports of a group spanning several hosts, and how they connect.

:class:`HostTransports` holds shared memory among each host's ranks
(``shm/``) and the process group's point-to-point across hosts
(``torchdist.py``); :class:`SubsetTransport` addresses the same-local-rank
peers on the other hosts. The hierarchical all-reduce runs on them;
:func:`connect` learns which ranks share a host (``topology.py``). A host whose
/dev/shm runs out drops its shared memory (:meth:`HostTransports.drop_local`,
[Note: a host without room in /dev/shm] in ``algos/hierarchical.py``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm.ops import Op
from gradring.comm.transport import Collective, CollectiveError, DirectTransport, Transport
from gradring.comm.transports.shm import rendezvous, space
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

    def start(self, info: Collective) -> None:
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
    """The transports of a multi-host group: shm inside the host, p2p across. It is
    itself a point-to-point transport over the whole group (delegating to ``flat``),
    so ring, tree and broadcast run on it unchanged; ``finish`` and ``mark_failed``
    pass to the host's shared memory (the closing agreement, [Note: sticky failures])."""

    name = "shm+torch"

    def __init__(self, topology: Topology, local: DirectTransport | None,
                 flat: Transport) -> None:
        # Which ranks share a host; fixed for the group's lifetime.
        self.topology = topology
        # Shared memory among this host's ranks (local ranks 0..L-1); None once the
        # host's /dev/shm ran out (``drop_local``): then ``intra`` carries those phases.
        self.local = local
        # Point-to-point among this host's ranks (local rank = index), over ``flat``.
        self.intra = SubsetTransport(flat, topology.local_ranks)
        # Point-to-point over the whole group (the process group's send/recv).
        self.flat = flat
        # The same, restricted to this rank's same-local-rank peer on every host.
        self.inter = SubsetTransport(flat, topology.peers)
        self.rank = flat.rank
        self.world_size = flat.world_size

    def start(self, info: Collective) -> None:
        self.flat.start(info)
        if self.local is not None:
            self.local.start(info)

    def finish(self) -> None:
        """End of a collective: the host's closing agreement (``ShmTransport.finish``)."""
        finish = getattr(self.local, "finish", None)
        if finish is not None:
            finish()

    def mark_failed(self, exc: BaseException) -> None:
        """This rank's collective failed (an exception in any phase, or the inter-host
        phase's error): fail the host's shared memory too, so host peers waiting in an
        intra-host phase stop at their next slice and name ``exc`` instead of timing out."""
        mark = getattr(self.local, "mark_failed", None)
        if mark is not None:
            mark(exc)

    def drop_local(self, exc: space.ShmExhausted, in_use: int | None = None) -> None:
        """Every rank of this host raised ``exc`` in this collective: give the host's
        shared memory up (its phases run over ``intra`` from now on) and warn once.
        ``in_use``: the most /dev/shm bytes a rank of the host holds (default: this
        rank's), for the warning's figure."""
        local, self.local = self.local, None
        if in_use is None:
            in_use = getattr(getattr(local, "memory", None), "reserved", 0)
        release = getattr(local, "release_for_fallback", None)
        if release is not None:
            release()
        topo = self.topology
        space.warn_once(space.advice(exc.needed, in_use, topo.local_size)
                        + f"; gradring now runs the intra-host phases on host "
                        f"{self._host_name()!r} over the process group instead (slower)")

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        return self.flat.isend(buf, dst)

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        return self.flat.irecv(buf, src, op)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        self.flat.wait_all(reqs)

    def close(self) -> None:
        """Close the host's shared memory; ``flat`` belongs to the group context."""
        if self.local is not None:
            self.local.close()

    def _host_name(self) -> str:
        topo = self.topology
        return topo.names[topo.host_index] if topo.names else f"host{topo.host_index}"

    def local_error(self, exc: CollectiveError) -> CollectiveError:
        """``exc`` (naming local ranks) with this host's local-to-group rank map."""
        topo = self.topology
        legend = ", ".join(f"local {i} = rank {r}" for i, r in enumerate(topo.local_ranks))
        return CollectiveError(f"{exc} [ranks above are local to host {self._host_name()!r}: "
                               f"{legend}]")


def connect(store: Any, rank: int, world_size: int, timeout: float,
            flat: Transport) -> HostTransports | None:
    """Learn the topology and connect each host's shared memory; collective. The
    transports when the group spans several hosts with the same number (> 1) of
    ranks each and every host's shared memory connected, else None: every rank
    reaches the same verdict (the last round agrees on all hosts' shm outcome)."""
    topo, prefix = exchange(store, rank, world_size, timeout)
    if topo.num_hosts == 1 or not topo.uniform or topo.local_size == 1:
        return None
    host_store = dist.PrefixStore(f"{prefix}host{topo.host_index}/", store)
    local, why = rendezvous.connect(host_store, topo.local_rank, topo.local_size, timeout)
    store.set(f"{prefix}shm/{rank}", json.dumps(why if local is None else ""))
    keys = [f"{prefix}shm/{p}" for p in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout))
    if any(json.loads(store.get(k)) for k in keys):  # some host's shared memory failed
        if local is not None:
            local.close()
        return None
    return HostTransports(topo, local, flat)  # type: ignore[arg-type]
