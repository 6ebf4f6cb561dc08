"""The peer board: what each rank of a group tells the others through the store.

[Note: the peer board]
Point-to-point waits cannot tell *who* is missing: in a ring every rank waits
for its left neighbour, stuck or not. Ranks that have been blocked for
``BOARD_AFTER_S`` post "waiting in #k" under ``gradring/board/<gen>/<rank>`` in
the group's store; a rank whose collective failed posts "failed in #k" (with
the reason) and a rank that shuts gradring down (``comm.shutdown()``, or at
exit) posts "left after #k". Nothing is posted on the fast path. ``<gen>``
comes from an atomic counter (``store.instance_prefix``), so a re-created
group or a restarted job on the same store never reads stale markers. Each
rank also posts its pid and host key (``topology.host_key``): a peer's pid
says whether it still lives only when both share a host.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from gradring.comm.store import instance_prefix
from gradring.comm.transports.shm import segments
from gradring.comm.transports.topology import host_key

#: Seconds a rank waits before telling the board it has arrived (keeps the fast path silent).
BOARD_AFTER_S = 0.5
#: How often blocked waits (torch transport, watchdog thread) consult the board.
POLL_S = 0.25


class PeerBoard:
    """Status markers of one group's ranks in its store; see [Note: the peer board]."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        # The group's private store (``store.group_store``).
        self._store = store
        self.rank = rank
        self.world_size = world_size
        # Key prefix of this group instance; fixed at the first use (collective order).
        self._prefix: str | None = None
        # The last status this rank posted, to skip repeats.
        self._posted: tuple[str, int] | None = None
        # Set once the store failed: stop trying (a dead TCPStore host).
        self._dead = False
        # Peers' (pid, host key) as they posted them, to tell a dead peer on this host.
        self._ids: dict[int, tuple[int, str]] = {}
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Join this group instance's generation (one ``add``; every rank calls it once)
        and post this process's identity."""
        if self._prefix is None and not self._dead:
            try:
                self._prefix = instance_prefix(self._store, "board", self.world_size)
                self._store.set(f"{self._prefix}id/{self.rank}",
                                json.dumps([os.getpid(), host_key()]))
            except Exception:  # noqa: BLE001 - diagnostics only
                self._dead = True

    def dead_peers(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of peers on this host whose process is gone."""
        if self._prefix is None or self._dead:
            return []
        me = host_key()
        with self._lock:
            for p in range(self.world_size):
                if p == self.rank or p in self._ids:
                    continue
                key = f"{self._prefix}id/{p}"
                try:
                    if self._store.check([key]):
                        pid, host = json.loads(self._store.get(key))
                        self._ids[p] = (pid, host)
                except Exception:  # noqa: BLE001 - diagnostics only
                    self._dead = True
                    return []
        return [(p, pid) for p, (pid, host) in sorted(self._ids.items())
                if host == me and not segments.pid_alive(pid)]

    def post(self, state: str, seq: int, what: str, why: str = "", error: str = "",
             fp: list[Any] | None = None) -> None:
        """Publish ``state`` ("waiting", "failed", "left") for collective ``seq``; best
        effort. ``error`` is the exception's type name (a desync stays a desync);
        ``fp`` the collective's fingerprint (waiting ranks compare them)."""
        if self._prefix is None or self._dead or self._posted == (state, seq):
            return
        value = json.dumps({"state": state, "seq": seq, "what": what, "why": why[:2000],
                            "error": error, "fp": fp, "pid": os.getpid(),
                            "time": time.time()})
        with self._lock:
            try:
                self._store.set(f"{self._prefix}{self.rank}", value)
                self._posted = (state, seq)
            except Exception:  # noqa: BLE001 - the store host may be gone
                self._dead = True

    def read(self) -> dict[int, dict[str, Any]]:
        """Every peer's latest status that exists (never blocks on a missing key)."""
        found: dict[int, dict[str, Any]] = {}
        if self._prefix is None or self._dead:
            return found
        with self._lock:
            for p in range(self.world_size):
                if p == self.rank:
                    continue
                key = f"{self._prefix}{p}"
                try:
                    if self._store.check([key]):
                        found[p] = json.loads(self._store.get(key))
                except Exception:  # noqa: BLE001 - diagnostics only
                    self._dead = True
                    break
        return found


def describe_status(rank: int, status: dict[str, Any] | None, seq: int = 0) -> str:
    """One peer's board status in words, for error messages (``seq``: ours)."""
    if status is None:
        return f"rank {rank} posted nothing (alive but not blocked in a gradring collective, " \
               "or stuck before one)"
    what = status.get("what", "")
    if status["state"] == "waiting":
        return f"rank {rank} is waiting in {what}"
    if status["state"] == "left":
        skipped = f", so it skipped #{seq}" if status["seq"] < seq else ""
        return f"rank {rank} (pid {status.get('pid')}) left gradring after {what}{skipped}"
    why = status.get("why", "")
    return f"rank {rank} failed in {what}: " + (why if len(why) <= 400 else why[:400] + "...")


def arrivals(seq: int, board: dict[int, dict[str, Any]], me: int,
             world_size: int) -> tuple[list[int], list[int]]:
    """Ranks known to have reached collective ``seq`` (this one included), and the rest."""
    arrived = [me] + [p for p, s in board.items()
                      if s["state"] in ("waiting", "failed") and s["seq"] == seq]
    return sorted(arrived), [p for p in range(world_size) if p not in arrived]
