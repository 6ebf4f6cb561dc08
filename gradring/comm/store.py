"""The store gradring keeps per process group, and fresh key prefixes inside it.

Every side channel of gradring -- the shared-memory rendezvous, the topology
exchange, the peer board, the diagnostics of DDP's error paths -- lives in
one store private to the process group (:func:`group_store`). A group may be
destroyed and re-created on the same store, and a restarted job may reuse
it, so a connection never trusts keys it did not write: it first draws a
*generation* from an atomic counter (:func:`instance_prefix`) and keeps its
keys under ``gradring/<what>/<generation>/``. Every rank of the group draws
once, in the same collective order, so all of them land on the same prefix.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gradring.comm.registry import GROUPS


def group_store(group: Any) -> Any:
    """A store private to ``group``: torch's own prefixed store of the group, else a
    prefix of the default store named after the group and its ranks."""
    try:
        return c10d._world.pg_map[group][1]
    except Exception:  # noqa: BLE001 - private API
        ranks = "-".join(map(str, dist.get_process_group_ranks(group)))
        return dist.PrefixStore(f"gradring/{group.group_name}/{ranks}/",
                                c10d._get_default_store())


def instance_prefix(store: Any, what: str, world_size: int) -> str:
    """``gradring/<what>/<generation>/``: keys nobody wrote before; collective (one
    atomic add per rank, every rank of ``world_size`` calls it once)."""
    n = store.add(f"gradring/{what}/arrivals", 1)
    return f"gradring/{what}/{(n - 1) // world_size}/"


def exchange_lists(comm: Any, tag: str, mine: list[int],
                   wait_s: float = 2.0) -> dict[int, list[int]]:
    """Publish ``mine`` under ``tag`` and collect what the other ranks published in time.

    ``comm`` has ``group``, ``rank`` and ``world_size``. Used on error paths,
    where ranks may disagree about which collective comes next, so the lists
    travel through the store and not through a collective. Without a store
    (none can be found) nothing is exchanged. After a collective of the group
    failed here, peers are gone or stopped: take what is there and do not wait
    (a rank that caught gradring's error and trains on gets its next error at
    once, as with torch).
    """
    if _group_failed(comm.group):
        wait_s = 0.0
    try:
        store = dist.PrefixStore("gradring/diag/", group_store(comm.group))
    except Exception:  # noqa: BLE001 - no store: no side channel
        return {}
    store.set(f"{tag}/{comm.rank}", json.dumps(mine))
    found: dict[int, list[int]] = {}
    deadline = time.monotonic() + wait_s
    others = [r for r in range(comm.world_size) if r != comm.rank]
    while others:
        for r in list(others):
            key = f"{tag}/{r}"
            if store.check([key]):
                found[r] = json.loads(store.get(key))
                others.remove(r)
        if not others or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return found


def _group_failed(group: Any) -> bool:
    """Whether a gradring collective of ``group`` has failed in this process."""
    try:
        key = group if group is not None else c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no default group
        return False
    return GROUPS.failed(key)
