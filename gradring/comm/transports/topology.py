"""Which ranks of a group share a host: identities exchanged through the store.

[Note: what "the same host" means]
Two ranks share a host for gradring when shared memory between them works:
same kernel (boot id), hostname, pid namespace (pids tell a dead peer from a
slow one) and ``/dev/shm`` (its tmpfs ``st_dev``). The network namespace is
part of the key too, so a test harness built from namespaces exercises the
cross-host path. This one definition serves the topology below, the shm
rendezvous (which still has the final word: it maps every peer's control
segment) and the peer board (a pid check means something only on the same
host). Grouping is a pure function (:func:`group_by_host`): hosts ordered by
their smallest rank, ranks ascending, so every rank computes the same
:class:`Topology`.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from gradring.comm.store import instance_prefix
from gradring.comm.transports.shm import segments


def _ns_inode(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return 0


def _shm_device(path: str = segments.SHM_DIR) -> int:
    try:
        return os.stat(path).st_dev
    except OSError:
        return -1


def host_identity() -> dict[str, Any]:
    """This process's host key (see [Note: what "the same host" means])."""
    return {"host": socket.gethostname(), "boot": segments.boot_id(),
            "netns": _ns_inode("net"), "pidns": segments.pid_namespace(),
            "shm": _shm_device()}


def host_key(identity: Mapping[str, Any] | None = None) -> str:
    """``identity`` (default: this process's) as text: equal exactly on one host."""
    return json.dumps(dict(host_identity() if identity is None else identity), sort_keys=True)


def group_by_host(identities: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """Ranks with equal identities, one list per host; hosts ordered by smallest rank.

    >>> group_by_host([{"h": "a"}, {"h": "b"}, {"h": "a"}, {"h": "b"}])
    [[0, 2], [1, 3]]
    """
    by_key: dict[str, list[int]] = {}
    for rank, ident in enumerate(identities):
        by_key.setdefault(host_key(ident), []).append(rank)
    return sorted(by_key.values(), key=lambda ranks: ranks[0])


@dataclass(frozen=True)
class Topology:
    """The group's ranks grouped by host, seen from one rank."""

    hosts: tuple[tuple[int, ...], ...]  # group ranks per host (hosts by smallest rank)
    rank: int  # this process's group rank
    names: tuple[str, ...] = ()  # hostname of each host, for messages

    def __post_init__(self) -> None:
        flat = sorted(r for h in self.hosts for r in h)
        if flat != list(range(len(flat))):
            raise ValueError(f"hosts {self.hosts} do not partition ranks 0..{len(flat) - 1}")
        if self.rank not in flat:
            raise ValueError(f"rank {self.rank} is not in hosts {self.hosts}")

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def host_index(self) -> int:
        return next(i for i, h in enumerate(self.hosts) if self.rank in h)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Group ranks on this rank's host, ascending (index = local rank)."""
        return self.hosts[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def uniform(self) -> bool:
        """True when every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @property
    def peers(self) -> tuple[int, ...]:
        """Group ranks with this rank's local rank, one per host (needs ``uniform``)."""
        if not self.uniform:
            raise ValueError(f"hosts have different numbers of ranks: "
                             f"{[len(h) for h in self.hosts]}")
        return tuple(h[self.local_rank] for h in self.hosts)

    def describe(self) -> str:
        parts = []
        for i, ranks in enumerate(self.hosts):
            name = self.names[i] if i < len(self.names) else f"host{i}"
            parts.append(f"{name}: ranks {list(ranks)}")
        return f"{self.num_hosts} host(s) -- " + "; ".join(parts)


def from_identities(identities: Sequence[Mapping[str, Any]], rank: int) -> Topology:
    """The topology all ranks compute from the same gathered identities."""
    hosts = group_by_host(identities)
    names = tuple(str(identities[h[0]].get("host", "?")) for h in hosts)
    return Topology(tuple(tuple(h) for h in hosts), rank, names)


def exchange(store: Any, rank: int, world_size: int, timeout: float, *,
             identity: Mapping[str, Any] | None = None) -> tuple[Topology, str]:
    """Publish this rank's identity under ``store``, gather everyone's; collective.

    Returns the topology and the store prefix this exchange used (unique per
    group instance, so later rounds of the same connection can live under it).
    ``identity`` replaces :func:`host_identity` (tests).
    """
    prefix = instance_prefix(store, "topo", world_size)
    mine = dict(identity) if identity is not None else host_identity()
    store.set(f"{prefix}id/{rank}", json.dumps(mine))
    keys = [f"{prefix}id/{p}" for p in range(world_size)]
    store.wait(keys, timedelta(seconds=timeout))
    identities = [json.loads(store.get(k)) for k in keys]
    return from_identities(identities, rank), prefix
