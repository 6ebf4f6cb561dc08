"""The store gradring keeps per process group, and fresh key prefixes inside it.

Every side channel (the shm rendezvous, the topology exchange, the peer board,
DDP's error paths) lives in one store private to the group
(:func:`group_store`). A group may be re-created on the same store and a
restarted job may reuse it, so keys go under ``gradring/<what>/<generation>/``,
the generation drawn from an atomic counter by every rank once, in the same
collective order (:func:`instance_prefix`).

[Note: store calls with a deadline]
A TCPStore call to an unreachable host waits for the store's own timeout, and
again at the next call; a watchdog blocked there enforces no deadline, and one
blocked holding a lock stops every thread that wants it (a cut-off host's
ranks once hung for minutes). So every store call of the watchdog's and the
error paths goes through a :class:`BoundedStore`: it runs on a helper thread,
on its own client connection (``store.clone()``), and the caller waits at most
``CALL_S`` seconds, then gets :class:`StoreUnreachable` -- at once, too, while
that call is still stuck: nothing queues behind it. The collective paths that
must wait for their peers keep their own, longer deadlines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gradring.comm import threads
from gradring.comm.registry import GROUPS
from gradring.comm.transport import CollectiveError

T = TypeVar("T")

#: Seconds one diagnostic store call (board, heartbeat, error paths) may take.
CALL_S = 2.0


#: Seconds an idle store helper thread waits for the next call before it ends.
HELPER_LINGER_S = 10.0
#: Timeout of a helper's own client connection: no store call of a helper blocks
#: longer, so its thread can always be stopped and joined (see [Note: gradring's
#: threads] in ``threads.py``).
CLIENT_TIMEOUT_S = 5.0


#: Longest pause between two polls of :func:`wait_keys`.
POLL_MAX_S = 0.2


def wait_keys(store: Any, keys: list[str], timeout: float,
              check_missing: Callable[[list[int]], None] | None = None) -> None:
    """Wait up to ``timeout`` s until every key of ``keys`` (one per rank, in rank order)
    exists, else raise the store's ``TimeoutError``. While it waits,
    ``check_missing(ranks whose key is missing)`` runs every few ms and may raise to end
    the wait (a peer known to be gone). Without it: one plain ``store.wait``."""
    if check_missing is None:
        store.wait(keys, timedelta(seconds=timeout))
        return
    deadline = time.monotonic() + timeout
    pause = 0.005
    while not store.check(keys):
        check_missing([p for p, k in enumerate(keys) if not store.check([k])])
        if time.monotonic() >= deadline:
            raise TimeoutError("Wait timeout")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, POLL_MAX_S)


def who_is_missing(store: Any, keys: list[str]) -> str:
    """``ranks [1, 3]``: the ranks whose key (one per rank, in rank order) is not in
    ``store``, for the error of a wait that ended without them; ``some ranks`` when
    the store itself no longer answers."""
    try:
        missing = [p for p, k in enumerate(keys) if not store.check([k])]
    except Exception:  # noqa: BLE001 - the store itself is gone
        missing = []
    return f"ranks {missing}" if missing else "some ranks"


def address(store: Any) -> str:
    """Where ``store`` lives, for messages: ``HOST:PORT`` of the TCPStore beneath any
    prefix stores, else the store's kind."""
    store = _bottom(store)
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is not None and port is not None:
        return f"{host}:{port}"
    return f"(a {type(store).__name__})"


def _bottom(store: Any) -> Any:
    """The store beneath any prefix stores."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store = store.underlying_store
        seen += 1
    return store


class StoreUnreachable(CollectiveError):
    """A store call got no answer within its deadline (see [Note: store calls with a
    deadline]); ``where`` is ``HOST:PORT``, ``silent_s`` how long nothing came back."""

    def __init__(self, where: str, silent_s: float, cause: str = "") -> None:
        super().__init__(f"the store at {where} is unreachable: no answer for "
                         f"{silent_s:.1f}s" + (f" ({cause})" if cause else ""))
        self.where = where
        self.silent_s = silent_s


class BoundedStore:
    """Calls to one store, each with a deadline; see [Note: store calls with a deadline]."""

    def __init__(self, store: Any, call_s: float = CALL_S) -> None:
        # The store as given (the group's own); cloned for this object's calls.
        self._base = store
        self.where = address(store)
        self.call_s = call_s
        # Guards the fields below (never held across a store call).
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # This object's client connection (a clone of ``_base``), made on the helper.
        self._client: Any = None
        # The call waiting for the helper thread, and the helper (started lazily).
        self._pending: tuple[Callable[[Any], Any], dict[str, Any], threading.Event] | None \
            = None
        self._helper: threads.GradringThread | None = None
        self._helper_pid = 0
        # Since when calls fail (monotonic), None while the store answers.
        self.failing_since: float | None = None
        # The last failure in words.
        self.last_error = ""
        # Whether the helper is inside a call (a stuck one makes later calls fail at once).
        self._busy = False
        # Set by the helper's stop(): it ends after the call it is in.
        self._stopping = False

    def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(store)`` on the helper thread; its result, its exception, or
        :class:`StoreUnreachable` after ``call_s`` seconds (at once while an earlier
        call is still stuck)."""
        box: dict[str, Any] = {}
        done = threading.Event()
        started = time.monotonic()
        with self._lock:
            if self._helper_pid != os.getpid():  # new, or forked: none of the parent's
                self._helper, self._busy, self._pending, self._client = None, False, None, None
                self._helper_pid = os.getpid()
            if self._busy:
                raise self._unreachable("an earlier call is still waiting")
            if self._helper is None or not self._helper.is_alive():
                if threads.exiting.is_set():
                    raise StoreUnreachable(self.where, 0.0, "this process is exiting")
                self._stopping = False
                self._helper = threads.GradringThread("gradring-store", self._serve,
                                                      self._ask_stop)
                self._helper.start()
            self._pending = (fn, box, done)
            self._busy = True
            self._wake.notify_all()
        if not done.wait(self.call_s):
            with self._lock:
                if self.failing_since is None:
                    self.failing_since = started
                self.last_error = f"no answer within {self.call_s:g}s"
            raise self._unreachable()
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, (KeyError, ValueError, TypeError, CollectiveError)):
                raise exc  # an answer, not a dead link (a missing key, a bad value)
            with self._lock:
                if self.failing_since is None:
                    self.failing_since = started
                self.last_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" \
                    if str(exc) else type(exc).__name__
            raise self._unreachable(self.last_error) from exc
        with self._lock:
            self.failing_since = None
            self.last_error = ""
        return box["value"]

    def unreachable(self) -> StoreUnreachable | None:
        """The error to report when the last call failed, else None."""
        with self._lock:
            return None if self.failing_since is None else self._unreachable(self.last_error)

    def _unreachable(self, cause: str = "") -> StoreUnreachable:
        since = self.failing_since
        silent = time.monotonic() - since if since is not None else self.call_s
        return StoreUnreachable(self.where, silent, cause or self.last_error)

    def _ask_stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()

    def stop(self) -> None:
        """Stop the helper thread (after the call it is in); return once it is dead."""
        helper = self._helper
        if helper is not None:
            helper.stop()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                idle_until = time.monotonic() + HELPER_LINGER_S
                while self._pending is None:
                    left = idle_until - time.monotonic()
                    if self._stopping or left <= 0:
                        if self._helper is me:
                            self._helper = None
                        return
                    self._wake.wait(left)
                fn, box, done = self._pending
                self._pending = None
            try:
                if self._client is None:
                    try:
                        client = self._base.clone()
                        if _bottom(client) is not _bottom(self._base):
                            # Its own connection: a short timeout bounds every call of it
                            # (a store whose clone is itself, a HashStore, keeps its own).
                            client.set_timeout(timedelta(seconds=max(CLIENT_TIMEOUT_S,
                                                                     self.call_s)))
                        self._client = client
                    except Exception:  # noqa: BLE001 - a store without clone: share it
                        self._client = self._base
                box["value"] = fn(self._client)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
                if not isinstance(exc, (KeyError, ValueError, TypeError, CollectiveError)):
                    self._client = None  # the connection's state is unknown: a new one
            finally:
                with self._lock:
                    self._busy = False
                    if "error" not in box:
                        self.failing_since = None
                        self.last_error = ""
                done.set()


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

    ``comm`` has ``group``, ``rank`` and ``world_size``. For error paths, where
    ranks may disagree about the next collective, so the lists go through the
    store (none found: nothing is exchanged). After a collective of the group
    failed here the peers are gone or stopped: take what is there, do not wait.
    """
    if _group_failed(comm.group):
        wait_s = 0.0
    try:
        store = dist.PrefixStore("gradring/diag/", group_store(comm.group))
    except Exception:  # noqa: BLE001 - no store: no side channel
        return {}
    rank, world = comm.rank, comm.world_size
    found: dict[int, list[int]] = {}

    def swap(s: Any) -> None:
        s.set(f"{tag}/{rank}", json.dumps(mine))
        deadline = time.monotonic() + wait_s
        others = [r for r in range(world) if r != rank]
        while others:
            for r in list(others):
                key = f"{tag}/{r}"
                if s.check([key]):
                    found[r] = json.loads(s.get(key))
                    others.remove(r)
            if not others or time.monotonic() >= deadline:
                break
            time.sleep(0.02)

    # An error path: the whole exchange has a deadline (see [Note: store calls with a
    # deadline]); a store that does not answer leaves what arrived so far.
    try:
        BoundedStore(store, wait_s + CALL_S).run(swap)
    except StoreUnreachable:
        pass
    return dict(found)


def _group_failed(group: Any) -> bool:
    """Whether a gradring collective of ``group`` has failed in this process."""
    try:
        key = group if group is not None else c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no default group
        return False
    return GROUPS.failed(key)
