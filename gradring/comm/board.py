"""The peer board: what each rank of a group tells the others through the store.

[Note: the peer board]
Point-to-point waits cannot tell *who* is missing: in a ring every rank waits
for its left neighbour, stuck or not. So ranks blocked for ``BOARD_AFTER_S``
post "waiting in #k" under ``gradring/board/<gen>/<rank>`` in the group's
store, a rank whose collective failed posts "failed in #k" (and why), and one
that shuts gradring down posts "left after #k" (or "left in #k", abandoned in
flight). Nothing is posted on the fast path. ``<gen>`` (``store.instance_prefix``)
keeps a re-created group or a restarted job from reading stale markers. Each
rank also posts its pid and host key: a pid tells whether a peer lives only on
a shared host.

[Note: the store is not trusted]
Any local process that reaches the job's store can write any key, so
everything read back is checked against what :meth:`PeerBoard.post` and
:meth:`PeerBoard.attach` write (:func:`parse_status`, :func:`parse_identity`)
before anything indexes it; a value that fails raises
:class:`StoreValueError`, naming the key, and the watchdog fails what it
watches with it instead of dying (docs/reliability.md, "Other local users").

[Note: heartbeats]
"Posted nothing" does not tell a busy rank from one that cannot reach the
store. So every attached board bumps ``gradring/board/<gen>/hb/<rank>`` every
``HEARTBEAT_S`` (one thread per process, until it posts "left"), and a waiting
rank reads its peers' counters with their statuses. A counter still for
``STALE_S`` of this rank's own clock (no clocks are compared) makes the peer
"unreachable". Every store call has a deadline and none is made under the
board's lock ([Note: store calls with a deadline] in ``store.py``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from typing import Any

from gradring.comm import threads
from gradring.comm.store import BoundedStore, StoreUnreachable, instance_prefix
from gradring.comm.transport import CollectiveError
from gradring.comm.transports.shm import segments
from gradring.comm.transports.topology import host_key

#: Seconds a rank waits before telling the board it has arrived (keeps the fast path silent).
BOARD_AFTER_S = 0.5
#: How often blocked waits (torch transport, watchdog thread) consult the board.
POLL_S = 0.25
#: How often each rank bumps its heartbeat counter (see [Note: heartbeats]).
HEARTBEAT_S = 1.0
#: A heartbeat that has not moved for this long counts as stopped: the rank is
#: cut off from the store (or its host is down or frozen).
STALE_S = 5.0


#: The states a rank posts (see :meth:`PeerBoard.post`).
STATES = ("waiting", "failed", "left")
#: The ``why`` of a "left" posted in collective ``seq``, which it abandoned in flight.
ABANDONED = "abandoned"
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
    """Status markers of one group's ranks in its store; see [Note: the peer board].

    Every store call goes through a :class:`~gradring.comm.store.BoundedStore` and
    none is made under ``_lock`` (see [Note: store calls with a deadline]): a store
    that cannot be reached makes the board's calls fail within ``CALL_S`` seconds
    (at once while one is stuck), and nothing waits for the lock meanwhile."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        # The group's private store (``store.group_store``), every call with a deadline.
        self._store = BoundedStore(store)
        self.rank = rank
        self.world_size = world_size
        # Key prefix of this group instance; fixed at the first use (collective order).
        self._prefix: str | None = None
        # The last status this rank posted, to skip repeats.
        self._posted: tuple[str, int] | None = None
        # Set once the board cannot be used (attach failed, or the store broke it).
        self._dead = False
        # Peers' (pid, host key) as they posted them, to tell a dead peer on this host.
        self._ids: dict[int, tuple[int, str]] = {}
        # Peers' heartbeats as seen here: rank -> (count, when it last moved, first seen).
        self._beats: dict[int, tuple[int, float, float]] = {}
        self._beats_read = 0.0
        # Whether this rank's heartbeat runs (until it posts "left").
        self.beating = False
        # Guards the fields above; never held across a store call.
        self._lock = threading.Lock()

    def attach(self) -> None:
        """Join this group instance's generation (one ``add``; every rank calls it once)
        and post this process's identity; start this rank's heartbeat."""
        if self._prefix is not None or self._dead:
            return
        ident = json.dumps([os.getpid(), host_key()])
        rank, world = self.rank, self.world_size

        def draw(store: Any) -> str:
            prefix = instance_prefix(store, "board", world)
            store.set(f"{prefix}id/{rank}", ident)
            return prefix

        try:
            self._prefix = self._store.run(draw)
        except Exception:  # noqa: BLE001 - diagnostics only; a late draw cannot be undone
            self._dead = True
            return
        self.beating = True
        HEARTBEAT.add(self)

    def store_unreachable(self) -> StoreUnreachable | None:
        """The store's failure when its last call got no answer, else None."""
        return self._store.unreachable()

    def _fetch(self, keys: list[str]) -> dict[str, Any] | None:
        """The raw values of ``keys`` that exist; None when the store did not answer
        in time (never blocks on a missing key, never longer than ``CALL_S``)."""
        def get(store: Any) -> dict[str, Any]:
            return {k: store.get(k) for k in keys if store.check([k])}

        try:
            return self._store.run(get)
        except StoreUnreachable:
            return None
        except Exception:  # noqa: BLE001 - diagnostics only: a store that answers nonsense
            self._dead = True
            return None

    def dead_peers(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of peers on this host whose process is gone. Raises
        StoreValueError for a peer identity gradring did not write."""
        if self._prefix is None or self._dead:
            return []
        with self._lock:
            wanted = [p for p in range(self.world_size) if p != self.rank and p not in self._ids]
        if wanted:
            raw = self._fetch([f"{self._prefix}id/{p}" for p in wanted])
            found = {}
            for p in wanted:
                key = f"{self._prefix}id/{p}"
                if raw is not None and key in raw:
                    found[p] = parse_identity(key, raw[key])
            with self._lock:
                self._ids.update(found)
        me = host_key()
        with self._lock:
            ids = sorted(self._ids.items())
        return [(p, pid) for p, (pid, host) in ids if host == me and not segments.pid_alive(pid)]

    def identities(self) -> dict[int, tuple[int, str]]:
        """The peers' ``(pid, host key)`` read so far."""
        with self._lock:
            return dict(self._ids)

    def post(self, state: str, seq: int, what: str, why: str = "", error: str = "",
             fp: list[Any] | None = None) -> None:
        """Publish ``state`` ("waiting", "failed", "left") for collective ``seq``; best
        effort. ``error`` is the exception's type name (a desync stays a desync);
        ``fp`` the collective's fingerprint (waiting ranks compare them)."""
        if self._prefix is None or self._dead or self._posted == (state, seq):
            return
        if state == "left":
            self.beating = False
        value = json.dumps({"state": state, "seq": seq, "what": what, "why": why[:2000],
                            "error": error, "fp": fp, "pid": os.getpid(),
                            "time": time.time()})
        key = f"{self._prefix}{self.rank}"
        try:
            self._store.run(lambda store: store.set(key, value))
        except StoreUnreachable:
            return
        except Exception:  # noqa: BLE001 - the store host may be gone
            self._dead = True
            return
        with self._lock:
            self._posted = (state, seq)

    def stop(self) -> None:
        """Stop this board's store helper thread (the next call starts it again)."""
        self._store.stop()

    def beat(self) -> None:
        """One heartbeat: bump this rank's counter in the store (see :data:`HEARTBEAT`)."""
        if self._prefix is None or self._dead or not self.beating:
            return
        key = f"{self._prefix}hb/{self.rank}"
        try:
            self._store.run(lambda store: store.add(key, 1))
        except Exception:  # noqa: BLE001 - recorded by the store wrapper; diagnostics only
            pass

    def read(self) -> dict[int, dict[str, Any]]:
        """Every peer's latest status that exists (never blocks on a missing key);
        the peers' heartbeats too, at most once per ``HEARTBEAT_S``. Raises
        StoreValueError for a status gradring did not write."""
        found: dict[int, dict[str, Any]] = {}
        if self._prefix is None or self._dead:
            return found
        peers = [p for p in range(self.world_size) if p != self.rank]
        prefix = self._prefix
        now = time.monotonic()
        with_beats = now - self._beats_read >= HEARTBEAT_S

        def get(store: Any) -> tuple[dict[int, Any], dict[int, int]]:
            raw = {p: store.get(f"{prefix}{p}") for p in peers
                   if store.check([f"{prefix}{p}"])}
            beats = {p: int(store.add(f"{prefix}hb/{p}", 0)) for p in peers} if with_beats \
                else {}
            return raw, beats

        try:
            raw, beats = self._store.run(get)
        except StoreUnreachable:
            return found
        except Exception:  # noqa: BLE001 - diagnostics only
            self._dead = True
            return found
        for p, value in sorted(raw.items()):
            found[p] = parse_status(f"{prefix}{p}", value)
        if beats:
            with self._lock:
                self._beats_read = now
                for p, count in beats.items():
                    old = self._beats.get(p)
                    if old is None:
                        self._beats[p] = (count, now, now)
                    elif count != old[0]:
                        self._beats[p] = (count, now, old[2])
        return found

    def cut_off(self, skip: set[int] | frozenset[int] = frozenset()) -> list[str]:
        """In words, the peers (not in ``skip``) whose heartbeat has not moved for
        ``STALE_S``: unreachable (see [Note: heartbeats])."""
        out = []
        for p in range(self.world_size):
            silent = self.silent_for(p) if p != self.rank and p not in skip else None
            if silent is not None and silent >= STALE_S:
                out.append(describe_status(p, None, 0, silent))
        return out

    def silent_for(self, rank: int) -> float | None:
        """Seconds, as seen from here, since ``rank``'s heartbeat last moved; None when
        unknown (it never beat, or was not watched long enough to tell)."""
        with self._lock:
            seen = self._beats.get(rank)
        if seen is None or seen[0] == 0:
            return None
        return time.monotonic() - seen[1]


class _Heartbeat:
    """One thread per process bumping the heartbeat of every attached board each
    ``HEARTBEAT_S`` (see [Note: heartbeats]); a :class:`~gradring.comm.threads.GradringThread`
    that ends when no board beats or when stopped (the next attached board starts it)."""

    def __init__(self) -> None:
        self._boards: weakref.WeakSet[PeerBoard] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threads.GradringThread | None = None
        self._pid = 0
        self._stopping = False

    def add(self, board: PeerBoard) -> None:
        with self._lock:
            self._boards.add(board)
            if threads.exiting.is_set():
                return
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._pid = os.getpid()
                self._stopping = False
                self._thread = threads.GradringThread("gradring-heartbeat", self._loop,
                                                      self._ask_stop)
                self._thread.start()

    def _ask_stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()

    def stop(self) -> None:
        """Stop the thread; return once it is dead."""
        thread = self._thread
        if thread is not None and self._pid == os.getpid():
            thread.stop()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                boards = [b for b in list(self._boards) if b.beating]
                if not boards or self._stopping:
                    if self._thread is me:
                        self._thread = None
                    return
            for b in boards:
                b.beat()
            with self._lock:
                if not self._stopping:
                    self._wake.wait(HEARTBEAT_S)


#: The process's heartbeat thread.
HEARTBEAT = _Heartbeat()


def describe_status(rank: int, status: dict[str, Any] | None, seq: int = 0,
                    silent: float | None = None) -> str:
    """One peer's board status in words, for error messages (``seq``: ours;
    ``silent``: seconds since its heartbeat last moved, None if unknown)."""
    if silent is not None and silent >= STALE_S and (status is None
                                                     or status["state"] == "waiting"):
        last = f"; its last post: waiting in {status.get('what', '')}" if status else ""
        return (f"rank {rank} is unreachable: its heartbeat in the store has not moved for "
                f"{silent:.0f}s (a network partition, or its host is down or frozen{last})")
    if status is None:
        if silent is not None:
            return (f"rank {rank} posted nothing but is alive (its heartbeat in the store "
                    "moves): it is not blocked in a gradring collective, or stuck before one")
        return (f"rank {rank} posted nothing (not blocked in a gradring collective, stuck "
                "before one, or cut off from the store)")
    what = status.get("what", "")
    if status["state"] == "waiting":
        return f"rank {rank} is waiting in {what}"
    if status["state"] == "left":
        skipped = f", so it skipped #{seq}" if status["seq"] < seq else ""
        how = f"in {what}, abandoning it" if status.get("why") == ABANDONED else f"after {what}"
        return f"rank {rank} (pid {status.get('pid')}) left gradring {how}{skipped}"
    why = status.get("why", "")
    return f"rank {rank} failed in {what}: " + (why if len(why) <= 400 else why[:400] + "...")


def arrivals(seq: int, board: dict[int, dict[str, Any]], me: int,
             world_size: int) -> tuple[list[int], list[int]]:
    """Ranks known to have reached collective ``seq`` (this one included), and the rest."""
    arrived = [me] + [p for p, s in board.items()
                      if s["state"] in ("waiting", "failed") and s["seq"] == seq]
    return sorted(arrived), [p for p in range(world_size) if p not in arrived]
