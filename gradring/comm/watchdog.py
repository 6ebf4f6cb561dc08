"""Timeouts, fail-fast markers and the flight recorder.

[Note: how a stuck collective ends]
Every collective gradring issues has a deadline: the process group's timeout
(torch: 30 min for CPU backends, 10 min for NCCL), or ``GRADRING_TIMEOUT``
seconds. Who enforces it depends on where the bytes move:

- shm: the waiting thread itself sleeps in 50 ms futex slices and, each
  slice, checks the deadline, whether peer pids live, and the peers' state
  words in their control segments (a peer that shut gradring down or failed
  says so there, see ``shm.py``);
- torch transport (gloo send/recv): ``wait_all`` waits in slices too and asks
  the group's :class:`PeerBoard` whether a peer has failed or left;
- native (``GRADRING_ALGO=native`` and the ops gradring hands to gloo): gloo's
  own timeout is the process group's; the :class:`Watchdog` thread fails the
  future gradring returned once *gradring's* deadline passes, or as soon as
  the board shows a failed or departed peer.

So a dead peer ends a collective within a slice or two (pid check on shm;
gloo's own "connection closed" plus the board elsewhere), a peer that left
early without Join ends it as soon as it exits or shuts gradring down, and a
peer that is merely stuck ends it at the deadline. The error names the
collective (sequence number, kind, bytes, dtype) and which ranks arrived and
which did not; the DDP reducer adds the bucket and its parameters.

[Note: the peer board]
Point-to-point waits cannot tell *who* is missing: in a ring every rank waits
for its left neighbour, stuck or not. Ranks that have been blocked for
``BOARD_AFTER_S`` post "waiting in #k" under ``gradring/board/<gen>/<rank>`` in
the group's store; a rank whose collective failed posts "failed in #k" (with
the reason) and a rank that shuts gradring down (``comm.shutdown()``, or at
exit) posts "left after #k". Nothing is posted on the fast path. ``<gen>``
comes from an atomic counter, so a re-created group or a restarted job on
the same store never reads stale markers.

Flight recorder: each process keeps its last ``GRADRING_FLIGHT_SIZE`` (256)
collectives in a ring buffer (:class:`Entry`: seq, kind, bytes, dtype, shape,
label -- e.g. the DDP bucket -- times, state). With
``GRADRING_FLIGHT_RECORDER=<dir>`` it is written to ``<dir>/rank<R>.json`` on
every collective failure and at exit; ``gradring flight <dir>`` merges the
ranks' files and points at the first collective the ranks disagree on.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gradring.comm import desync
from gradring.comm.transports.shm import segments

#: Seconds a rank waits before telling the board it has arrived (keeps the fast path silent).
BOARD_AFTER_S = 0.5
#: How often blocked waits (torch transport, watchdog thread) consult the board.
POLL_S = 0.25
#: Ring-buffer length of the flight recorder.
FLIGHT_SIZE = int(os.environ.get("GRADRING_FLIGHT_SIZE", "256"))
#: Seconds an idle watchdog thread lingers before exiting.
_LINGER_S = 5.0

# --------------------------------------------------------------------------- labels
_local = threading.local()


@contextlib.contextmanager
def label(text: str) -> Iterator[None]:
    """Label the collectives issued inside (e.g. ``"bucket 3"``) for errors and the recorder."""
    prev = getattr(_local, "label", None)
    _local.label = text
    try:
        yield
    finally:
        _local.label = prev


def current_label() -> str | None:
    return getattr(_local, "label", None)


# --------------------------------------------------------------------- flight recorder
class Entry:
    """One collective as the flight recorder keeps it."""

    __slots__ = ("group", "seq", "kind", "nbytes", "dtype", "shape", "label", "algo",
                 "issued", "started", "ended", "state", "error")

    def __init__(self, group: str, seq: int, kind: str, nbytes: int, dtype: torch.dtype,
                 shape: Sequence[int], algo: str = "") -> None:
        self.group = group  # process group name
        self.seq = seq  # per-group issue number, equal on every rank
        self.kind = kind  # "all_reduce", "broadcast", ...
        self.nbytes = nbytes  # bytes of this rank's input
        self.dtype = dtype  # converted to text only when shown (keeps issue cheap)
        self.shape = shape
        self.label = getattr(_local, "label", None)  # e.g. "DDP bucket 3" (comm.label)
        self.algo = algo  # filled in when it starts
        self.issued = time.time()  # wall clock: comparable across ranks of one host
        self.started: float | None = None
        self.ended: float | None = None
        self.state = "issued"  # issued -> started -> completed | failed
        self.error = ""

    def start(self, algo: str) -> None:
        self.algo, self.started, self.state = algo, time.time(), "started"

    def finish(self) -> None:
        self.ended, self.state = time.time(), "completed"

    def fail(self, error: str) -> None:
        self.ended, self.state, self.error = time.time(), "failed", error

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        what = f"{self.kind} #{self.seq} ({self.nbytes} bytes, {dtype}"
        what += f", shape {list(self.shape)}" if len(self.shape) else ""
        return what + (f", {self.label})" if self.label else ")")

    def fingerprint(self) -> list[Any]:
        """What must agree across ranks (shape and label only with ``GRADRING_CHECK``)."""
        full = desync.enabled()
        return [self.kind, self.nbytes, str(self.dtype), list(self.shape) if full else None,
                self.label if full else None]

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["dtype"] = str(self.dtype).replace("torch.", "")
        d["shape"] = list(self.shape)
        return d


class FlightRecorder:
    """The last ``size`` collectives of this process, all groups together."""

    def __init__(self, size: int = FLIGHT_SIZE) -> None:
        self._ring: deque[Entry] = deque(maxlen=size)
        # Why the recorder was dumped so far ("timeout in all_reduce #7", "exit").
        self.reasons: list[str] = []
        # Group name -> this process's rank in it and its size (to know who is missing).
        self.groups: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def note_group(self, name: str, rank: int, world_size: int) -> None:
        self.groups[name] = {"rank": rank, "world_size": world_size}

    def issue(self, group: str, seq: int, kind: str, nbytes: int, dtype: torch.dtype,
              shape: Sequence[int]) -> Entry:
        entry = Entry(group, seq, kind, nbytes, dtype, shape)
        self._ring.append(entry)  # deque.append is atomic under the GIL
        return entry

    def entries(self) -> list[Entry]:
        return list(self._ring)

    def clear(self) -> None:
        self._ring.clear()
        self.reasons = []

    def snapshot(self, reason: str) -> dict[str, Any]:
        rank = dist_rank()
        return {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
                "time": time.time(), "reasons": self.reasons + [reason],
                "groups": dict(self.groups), "entries": [e.as_dict() for e in self.entries()]}

    def dump(self, reason: str, directory: str | None = None) -> str | None:
        """Write this rank's buffer to ``directory`` (default ``$GRADRING_FLIGHT_RECORDER``)."""
        directory = directory or os.environ.get("GRADRING_FLIGHT_RECORDER")
        if not directory:
            return None
        with self._lock:
            data = self.snapshot(reason)
            self.reasons.append(reason)
            try:
                os.makedirs(directory, exist_ok=True)
                name = f"rank{data['rank']}.json" if data["rank"] >= 0 \
                    else f"pid{data['pid']}.json"
                path = os.path.join(directory, name)
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, path)
            except OSError:
                return None
        return path


def dist_rank() -> int:
    """Global rank, or -1 outside a process group."""
    import torch.distributed as dist

    try:
        return dist.get_rank() if dist.is_initialized() else -1
    except Exception:  # noqa: BLE001 - being torn down
        return -1


recorder = FlightRecorder()


def _dump_at_exit() -> None:
    if recorder.entries():
        recorder.dump("exit")


atexit.register(_dump_at_exit)


# -------------------------------------------------------------------------- peer board
class PeerBoard:
    """Status markers of one group's ranks in its store; see [Note: the peer board]."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        # The group's private store (``context._group_store``).
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
                n = self._store.add("gradring/board/instances", 1)
                self._prefix = f"gradring/board/{(n - 1) // self.world_size}/"
                self._store.set(f"{self._prefix}id/{self.rank}",
                                json.dumps([os.getpid(), _host_key()]))
            except Exception:  # noqa: BLE001 - diagnostics only
                self._dead = True

    def dead_peers(self) -> list[tuple[int, int]]:
        """``(rank, pid)`` of peers on this host whose process is gone."""
        if self._prefix is None or self._dead:
            return []
        me = _host_key()
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


def _host_key() -> str:
    """Same value on two processes only if one can see the other's pid."""
    return f"{socket.gethostname()}/{segments.boot_id()}/{segments.pid_namespace()}"


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


# ------------------------------------------------------------------- watchdog thread
class WatchdogError(RuntimeError):
    """The watchdog's verdict: the deadline passed, or a peer failed or left."""

    def __init__(self, message: str, peer_error: str = "") -> None:
        super().__init__(message)
        # Type name of the failed peer's own error ("DesyncError"), if that was the cause.
        self.peer_error = peer_error


class _Watched:
    __slots__ = ("entry", "future", "value", "deadline", "timeout", "board", "rank",
                 "world_size", "on_fail", "owner", "settled")

    def __init__(self, entry: Entry, future: torch.futures.Future, value: list,
                 timeout: float, board: PeerBoard | None, rank: int, world_size: int,
                 on_fail: Callable[[BaseException], BaseException], owner: Any) -> None:
        self.entry = entry  # what the collective is
        self.future = future  # gradring's future, completed by gloo's callback or here
        self.value = value  # what it resolves to
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.board = board  # fail-fast markers of the group
        self.rank = rank
        self.world_size = world_size
        self.on_fail = on_fail  # turns the cause into the error the caller sees
        self.owner = owner  # the group context, to cancel its work at shutdown
        self.settled = False  # guarded by Watchdog._lock


class Watchdog:
    """Fails native collectives that outlive gradring's deadline or lose a peer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._watched: list[_Watched] = []
        self._thread: threading.Thread | None = None
        self._stop = False

    def watch(self, entry: Entry, native: torch.futures.Future, timeout: float,
              board: PeerBoard | None, rank: int, world_size: int, value: list,
              on_fail: Callable[[BaseException], BaseException],
              owner: Any = None) -> torch.futures.Future:
        """Return a future that follows ``native`` but fails at the deadline."""
        fut: torch.futures.Future = torch.futures.Future()
        w = _Watched(entry, fut, value, timeout, board, rank, world_size, on_fail, owner)
        with self._lock:
            self._watched.append(w)
            if self._thread is None:  # it polls every POLL_S: no wake-up per collective
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="gradring-watchdog",
                                                daemon=True)
                self._thread.start()
        native.add_done_callback(lambda f: self._native_done(w, f))
        return fut

    def _native_done(self, w: _Watched, f: torch.futures.Future) -> None:
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            self._settle(w, w.on_fail(exc))
        else:
            self._settle(w, None)

    def _settle(self, w: _Watched, exc: BaseException | None) -> None:
        with self._lock:
            if w.settled:
                return
            w.settled = True
            if w in self._watched:
                self._watched.remove(w)
        final = w.entry.state in ("completed", "failed")
        if exc is None:
            if not final:
                w.entry.finish()
            w.future.set_result(w.value)
        else:
            if not final:
                w.entry.fail(str(exc))
            w.future.set_exception(exc)

    def _check(self, w: _Watched, now: float, seen: dict[int, Any]) -> BaseException | None:
        """The verdict on ``w``, if any; ``seen`` caches board reads within one poll."""
        e = w.entry
        if e.state == "failed":
            return None  # it failed here already: its own error is on the way
        waited = now - (w.deadline - w.timeout)
        board: dict[int, dict[str, Any]] = {}
        if w.board is not None and (waited >= BOARD_AFTER_S or now >= w.deadline):
            fp = e.fingerprint()
            w.board.post("waiting", e.seq, e.describe(), fp=fp)
            if id(w.board) not in seen:
                seen[id(w.board)] = (w.board.dead_peers(), w.board.read())
            dead, board = seen[id(w.board)]
            if dead:
                return WatchdogError("; ".join(f"rank {p} (pid {pid}) has exited"
                                               for p, pid in dead))
            for p, status in sorted(board.items()):
                if status["state"] == "waiting" and status["seq"] == e.seq \
                        and status.get("fp") not in (None, fp):
                    differ = ", ".join(n for n, a, b in zip(
                        ("kind", "byte size", "dtype", "shape", "label"), fp, status["fp"])
                        if a != b)
                    return WatchdogError(
                        f"gradring desync on rank {w.rank}: rank {w.rank} issued "
                        f"{e.describe()} but rank {p} issued {status['what']} [{differ} "
                        f"differ]: ranks issued different collectives (group {e.group})",
                        "DesyncError")
                if status["state"] == "failed" or (status["state"] == "left"
                                                   and status["seq"] < e.seq):
                    return WatchdogError(describe_status(p, status, e.seq),
                                         status.get("error", ""))
        if now >= w.deadline:
            came, missing = arrivals(e.seq, board, w.rank, w.world_size)
            notes = "; ".join(describe_status(p, board.get(p), e.seq) for p in missing)
            return WatchdogError(f"timed out after {w.timeout:g}s: ranks {came} arrived, "
                                 f"ranks {missing} did not arrive; {notes}")
        return None

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._stop:
                    self._thread = None
                    return
                if not self._watched and time.monotonic() - idle_since > _LINGER_S:
                    self._thread = None
                    return
                self._wake.wait(POLL_S)
                watched = list(self._watched)
            now = time.monotonic()
            if watched:
                idle_since = now
            seen: dict[int, Any] = {}
            for w in watched:
                cause = self._check(w, now, seen)
                if cause is not None:
                    self._settle(w, w.on_fail(cause))

    def cancel(self, owner: Any, reason: str) -> None:
        """Fail what is still watched for ``owner`` (its group is shutting down)."""
        with self._lock:
            pending = [w for w in self._watched if w.owner is owner]
        for w in pending:
            self._settle(w, w.on_fail(RuntimeError(reason)))

    def stop(self) -> None:
        """Stop the thread (``comm.shutdown()``); the next watch starts a new one."""
        with self._lock:
            self._stop = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        with self._lock:
            self._stop = False


watchdog = Watchdog()


def _reset_in_child() -> None:
    """A forked child has none of its parent's threads or pending collectives."""
    watchdog.__init__()
    recorder.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
