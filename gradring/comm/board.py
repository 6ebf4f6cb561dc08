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

[Note: the store is not trusted]
Any local process that can reach the job's store (a TCPStore port, a
FileStore file) can write any key. Everything read back is therefore checked
against what :meth:`PeerBoard.post` and :meth:`PeerBoard.attach` write --
JSON of the right shape, field types and ranges (:func:`parse_status`,
:func:`parse_identity`) -- before anything indexes it. A value that fails
raises :class:`StoreValueError`, which names the key; the watchdog fails the
collectives it watches with it (see watchdog.py), so a forged value ends the
wait with an error instead of killing the thread that enforces the deadline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from gradring.comm.store import instance_prefix
from gradring.comm.transport import CollectiveError
from gradring.comm.transports.shm import segments
from gradring.comm.transports.topology import host_key

#: Seconds a rank waits before telling the board it has arrived (keeps the fast path silent).
BOARD_AFTER_S = 0.5
#: How often blocked waits (torch transport, watchdog thread) consult the board.
POLL_S = 0.25


#: The states a rank posts (see :meth:`PeerBoard.post`).
STATES = ("waiting", "failed", "left")
#: Longest value accepted from the store (``why`` is cut at 2,000 characters).
MAX_VALUE_BYTES = 64 * 1024
_MAX_INT = 2**63 - 1


class StoreValueError(CollectiveError):
    """A value in the group's store is not one gradring wrote (forged or corrupt);
    ``key`` is its key in the group's store. See [Note: the store is not trusted]."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"gradring: the value of store key {key!r} is not one gradring "
                         f"writes: {problem}; another process with access to the job's "
                         "store may have written it")
        self.key = key


def _shown(raw: Any) -> str:
    text = repr(raw[:60]) if isinstance(raw, (bytes, str)) else repr(raw)
    return text + ("..." if isinstance(raw, (bytes, str)) and len(raw) > 60 else "")


def _json_value(key: str, raw: Any) -> Any:
    """``raw`` (bytes from ``store.get``) decoded as JSON, or StoreValueError."""
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, (bytes, bytearray)):
        raise StoreValueError(key, f"expected bytes, got {type(raw).__name__}")
    if len(raw) > MAX_VALUE_BYTES:
        raise StoreValueError(key, f"{len(raw)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreValueError(key, f"{_shown(raw)} is not JSON ({exc})") from None


def _is_int(v: Any, low: int, high: int = _MAX_INT) -> bool:
    return type(v) is int and low <= v <= high


def parse_status(key: str, raw: Any) -> dict[str, Any]:
    """A peer's status as :meth:`PeerBoard.post` writes it, checked field by field
    (unknown fields dropped); StoreValueError naming ``key`` otherwise."""
    v = _json_value(key, raw)
    if not isinstance(v, dict):
        raise StoreValueError(key, f"{_shown(raw)} is a JSON {type(v).__name__}, not an "
                                   "object with the fields state, seq, what, pid")
    if v.get("state") not in STATES:
        raise StoreValueError(key, f"state {v.get('state')!r} is not one of {', '.join(STATES)}")
    if not _is_int(v.get("seq"), 0):
        raise StoreValueError(key, f"seq {v.get('seq')!r} is not a whole number >= 0")
    if not _is_int(v.get("pid"), 1, 2**31 - 1):
        raise StoreValueError(key, f"pid {v.get('pid')!r} is not a process id")
    out: dict[str, Any] = {"state": v["state"], "seq": v["seq"], "pid": v["pid"]}
    for name in ("what", "why", "error"):
        text = v.get(name, "")
        if not isinstance(text, str):
            raise StoreValueError(key, f"{name} {text!r} is not text")
        out[name] = text
    fp = v.get("fp")
    if fp is not None and not (isinstance(fp, list) and len(fp) <= 4096
                               and all(type(w) is int for w in fp)):
        raise StoreValueError(key, f"fp {_shown(repr(fp))} is not a list of whole numbers")
    out["fp"] = fp
    t = v.get("time", 0.0)
    if type(t) not in (int, float):
        raise StoreValueError(key, f"time {t!r} is not a number")
    out["time"] = float(t)
    return out


def parse_identity(key: str, raw: Any) -> tuple[int, str]:
    """A peer's ``(pid, host key)`` as :meth:`PeerBoard.attach` writes it; StoreValueError
    naming ``key`` otherwise."""
    v = _json_value(key, raw)
    if not (isinstance(v, list) and len(v) == 2):
        raise StoreValueError(key, f"{_shown(raw)} is not a [pid, host] pair")
    pid, host = v
    if not _is_int(pid, 1, 2**31 - 1):
        raise StoreValueError(key, f"pid {pid!r} is not a process id")
    if not isinstance(host, str) or len(host) > 4096:
        raise StoreValueError(key, f"host {_shown(host)} is not a host key")
    return pid, host


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

    def _get(self, key: str) -> Any | None:
        """The raw value at ``key``, None when it is missing; a store that fails marks
        the board dead (then None too). Never blocks on a missing key."""
        try:
            return self._store.get(key) if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - diagnostics only: the store host may be gone
            self._dead = True
            return None

    def dead_peers(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of peers on this host whose process is gone. Raises
        StoreValueError for a peer identity gradring did not write."""
        if self._prefix is None or self._dead:
            return []
        me = host_key()
        with self._lock:
            for p in range(self.world_size):
                if p == self.rank or p in self._ids:
                    continue
                key = f"{self._prefix}id/{p}"
                raw = self._get(key)
                if self._dead:
                    return []
                if raw is not None:
                    self._ids[p] = parse_identity(key, raw)
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
        """Every peer's latest status that exists (never blocks on a missing key).
        Raises StoreValueError for a status gradring did not write."""
        found: dict[int, dict[str, Any]] = {}
        if self._prefix is None or self._dead:
            return found
        with self._lock:
            for p in range(self.world_size):
                if p == self.rank:
                    continue
                key = f"{self._prefix}{p}"
                raw = self._get(key)
                if self._dead:
                    break
                if raw is not None:
                    found[p] = parse_status(key, raw)
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
