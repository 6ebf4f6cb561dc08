"""Settings every rank of a group must share, agreed once when the group's state is made.

[Note: agreed settings]
``GRADRING_TRANSPORT``, ``GRADRING_ALGO`` and ``GRADRING_CHECK`` decide what
a rank does inside a collective (whose rendezvous it joins, which messages it
sends, whether a fingerprint goes ahead of the data). A rank whose value
differed used to wait in a rendezvous nobody else joined until the deadline,
or to report a desync that was none. So when a group's state is made (its
first gradring call, which every rank makes) each rank publishes these values
in the group's store and reads everyone's: one store round per group instance,
never per collective. When they differ every rank raises
:class:`SettingsMismatch` and the group refuses later collectives until
``comm.shutdown()``. Each rank publishes its pid and host too: a peer already
known to be gone from this host ends the wait at once ([Note: naming a peer
behind a gloo error] in ``peers.py``). The three are re-read per collective
([Note: when the environment is read] in ``config.py``): switching one later is
the caller's to do alike on every rank. docs/reliability.md ("Settings that
must match across ranks") has the messages and why the others may differ.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from gradring import config
from gradring.comm import peers
from gradring.comm.store import instance_prefix, wait_keys, who_is_missing
from gradring.comm.transport import CollectiveError
from gradring.comm.transports.topology import host_key
from gradring.config import SettingsMismatch

#: The :class:`~gradring.config.Config` fields every rank of a group must set alike.
AGREED = ("transport", "algo", "check")
_VARS = {f: config.Config.__dataclass_fields__[f].metadata["env"] for f in AGREED}


def published(cfg: config.Config, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a rank publishes: per agreed variable, ``[parsed value, raw text or None]``."""
    env = os.environ if environ is None else environ
    return {v: [getattr(cfg, f), env.get(v)] for f, v in _VARS.items()}


def _spell(raw: Any) -> str:
    return "it unset" if raw is None else repr(raw)


def _ranks(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 1, 2``, ``ranks 0-5, 7``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else
                     f"{start}, {prev}" if prev == start + 1 else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def mismatches(values: list[Any]) -> list[str]:
    """One sentence per agreed variable whose parsed values differ between the ranks
    whose ``published`` dicts are ``values`` (index: rank); empty when all agree."""
    found = []
    for var in _VARS.values():
        # parsed value -> (the first rank's raw spelling, ranks), in order of first rank
        seen: dict[str, tuple[Any, list[int]]] = {}
        for rank, v in enumerate(values):
            pair = v.get(var) if isinstance(v, dict) else None
            parsed, raw = (pair[0], pair[1]) if isinstance(pair, list) and len(pair) == 2 \
                else ("?", "?")
            key = json.dumps(parsed)
            if key not in seen:
                seen[key] = (raw, [])
            seen[key][1].append(rank)
        if len(seen) > 1:
            has = [f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {_spell(raw)}"
                   for raw, rs in seen.values()]
            found.append(f"{var} differs across ranks: {', '.join(has)}")
    return found


def _wait_alive(store: Any, keys: list[str], timeout: float, group: str, rank: int) -> None:
    """Wait up to ``timeout`` s until every key exists. While it waits, a rank whose
    process is known (``peers.py``: DDP's verification learnt it) and gone on this host
    ends the wait at once with a CollectiveError naming it and how it ended (see [Note:
    agreed settings]). Without such knowledge: one plain ``store.wait``."""
    others = [p for p in range(len(keys)) if p != rank]
    check = None
    if any(p in peers.known(group) for p in others):
        check = peers.failing_if_gone(
            group, f"before its first gradring call on this group; rank {rank} waited "
            f"there to agree on {', '.join(_VARS.values())}")
    wait_keys(store, keys, timeout, check)


def agree(store: Any, rank: int, world_size: int, timeout: float,
          group: str) -> dict[int, tuple[int, str]]:
    """Publish this rank's agreed settings in ``store`` (private to the group), read
    every rank's, and raise :class:`SettingsMismatch` on every rank when they differ
    (see [Note: agreed settings]); collective: every rank of the group calls it once
    per group instance. A rank that does not publish within ``timeout`` seconds is a
    :class:`~gradring.comm.transport.CollectiveError` naming it. Returns every
    rank's ``(pid, host key)`` as published there."""
    if world_size <= 1:
        return {}
    prefix = instance_prefix(store, "settings", world_size)
    store.set(f"{prefix}{rank}", json.dumps(dict(published(config.current()),
                                                 pid=os.getpid(), host=host_key())))
    keys = [f"{prefix}{p}" for p in range(world_size)]
    try:
        _wait_alive(store, keys, timeout, group, rank)
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch's DistStoreError (or a closed store)
        raise CollectiveError(
            f"gradring group {group}: {who_is_missing(store, keys)} did not make their "
            f"first gradring call on this group within {timeout:g}s; rank {rank} waited "
            f"there to agree on "
            f"{', '.join(_VARS.values())} (a rank that is gone or stuck before it, or that "
            f"issues a collective of another group or of torch first). Store: {exc}"
        ) from None
    values = []
    for k in keys:
        try:
            values.append(json.loads(store.get(k)))
        except ValueError:
            values.append(None)
    found = mismatches(values)
    if found:
        raise SettingsMismatch(f"gradring group {group}: " + "; ".join(found)
                               + "; set " + ("it" if len(found) == 1 else "them")
                               + " the same on every rank")
    return {p: (v["pid"], v["host"]) for p, v in enumerate(values)
            if isinstance(v, dict) and type(v.get("pid")) is int
            and isinstance(v.get("host"), str)}
