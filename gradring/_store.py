"""Side-channel exchanges through torch.distributed's store (error paths only).

Collectives pair up by issue order; when ranks may disagree about what they
issued (the situation most errors describe), a collective could pair with the
wrong partner. The store has no such pairing, so diagnostics go through it.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def group_store(comm: Any) -> Any | None:
    """A store namespaced to ``comm.group`` (None when none can be found)."""
    try:
        store = c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default store: no side channel
        return None
    ranks = dist.get_process_group_ranks(comm.group)
    return dist.PrefixStore("gradring/diag/" + "-".join(map(str, ranks)) + "/", store)


def exchange_lists(comm: Any, tag: str, mine: list[int],
                   wait_s: float = 2.0) -> dict[int, list[int]]:
    """Publish ``mine`` under ``tag`` and collect what the other ranks published in time."""
    store = group_store(comm)
    if store is None:
        return {}
    store.set(f"{tag}/{comm.rank}", json.dumps(mine))
    found: dict[int, list[int]] = {}
    deadline = time.monotonic() + wait_s
    others = [r for r in range(comm.world_size) if r != comm.rank]
    while others and time.monotonic() < deadline:
        for r in list(others):
            key = f"{tag}/{r}"
            if store.check([key]):
                found[r] = json.loads(store.get(key))
                others.remove(r)
        if others:
            time.sleep(0.02)
    return found


def wait_key(store: Any, key: str, timeout_s: float) -> bool:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return True
    except Exception:  # noqa: BLE001 - a missing key is the answer
        return False
