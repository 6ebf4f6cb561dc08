"""Per-process-group state, kept in the registry of groups (``registry.py``).

A :class:`GroupContext` is made on a group's first gradring call (a collective
or ``comm.empty``, which every rank must make: the settings agreement and the
transports' rendezvous go through the group's store) and lives until
``comm.shutdown()``, ``destroy_process_group`` or exit. It holds what the
group's collectives share (sequence numbers, engine, deadline) and owns their
transports, failures, board and watches.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import itertools
import multiprocessing
import multiprocessing.util
import os
import threading
from typing import Any

import torch
import torch.distributed as dist

from gradring import config
from gradring.comm import agree, engine, leaving, peers, root_cause, select, threads
from gradring.comm.board import ABANDONED, HEARTBEAT, PeerBoard
from gradring.comm.failures import Failures
from gradring.comm.recorder import RECORDER, Entry
from gradring.comm.registry import GROUPS
from gradring.comm.store import group_store
from gradring.comm.transports.group import GroupTransports
from gradring.comm.transports.shm import orphans, sigterm
from gradring.comm.transports.shm.transport import live_transports
from gradring.comm.watchdog import WATCHDOG

#: torch's default for non-NCCL groups, used when the group's timeout is unknown.
DEFAULT_TIMEOUT_S = 1800.0


def _group_timeout(group: Any) -> float:
    override = config.current().timeout
    if override is not None:
        return override
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return DEFAULT_TIMEOUT_S


class GroupContext:
    """Everything gradring keeps per process group."""

    def __init__(self, group: Any) -> None:
        # The torch process group (default group when the caller passed None).
        self.group = group
        # This process's rank in the group and the group's size.
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Name for messages and thread names.
        self.name = str(getattr(group, "group_name", "?"))
        # Deadline of every collective: the group's timeout unless GRADRING_TIMEOUT.
        self.timeout = _group_timeout(group)
        # Runs this group's collectives in issue order (see [Note: one engine per group]).
        self.engine = engine.Engine(f"gradring-comm-{self.name}")
        # Issue numbers, identical on all ranks when they issue the same sequence.
        self._seq = itertools.count(1)
        # The group's transports, connected on first use.
        self.transports = GroupTransports(
            group, self.rank, self.world_size, self.timeout,
            peers.failing_if_gone(self.name, f"before the shared-memory rendezvous of this "
                                             f"group; rank {self.rank} waited there"))
        # Fail-fast markers in the group's store, attached by the first watched collective.
        self.board = PeerBoard(group_store(group), self.rank, self.world_size)
        # Failure state (failed here; unusable after a watchdog verdict) and errors.
        self.failures = Failures(self.board, self.rank, self.world_size, self.name)
        self.failures.progress = self.peer_progress
        # The shm transport small synchronous all-reduces run on, once connected
        # (see [Note: the small synchronous path] in ``runner.py``); set by api._issue.
        self.small: Any = None
        # The last sequence numbers this rank issued, and issued and completed (in
        # issue order): the board's "left" post names either (see close()).
        self.issued = self.last_seq = 0
        # Whether the ranks' settings were compared yet (see agree_settings).
        self._agreed = False
        self._agree_lock = threading.Lock()
        RECORDER.note_group(self.name, self.rank, self.world_size)

    def agree_settings(self) -> None:
        """Compare the settings every rank must share, once per group instance
        (collective: see [Note: agreed settings] in ``agree.py``). A mismatch, or a
        rank that never comes, raises here and leaves the group refusing collectives."""
        with self._agree_lock:
            if self._agreed:
                return
            self._agreed = True
            try:
                ids = agree.agree(group_store(self.group), self.rank, self.world_size,
                                  self.timeout, self.name)
            except Exception as exc:
                self.failures.record(None, exc)
                self.failures.broken = str(exc)
                raise
            if ids and not peers.known(self.name):
                peers.learn(self.group, ids)  # the shm rendezvous watches them

    def peer_progress(self) -> dict[int, dict[str, Any]]:
        """What this rank sees of each peer's progress: the shm status block (the
        collective it started last, its state), else the peer board's last post."""
        found: dict[int, dict[str, Any]] = {}
        shm = self.transports.existing_shm()
        if shm is not None:
            found.update(shm.peer_progress())
        for p, s in self.board.read().items():
            found.setdefault(p, {"seq": s["seq"], "state": s["state"], "what": s["what"],
                                 "source": "peer board"})
        return found

    def has_failed(self) -> bool:
        """Whether a collective of this group failed here, or the watchdog gave up on one
        the engine is still blocked in (see ``failures.py``)."""
        return self.failures.failed or self.failures.broken is not None

    def next_seq(self) -> int:
        self.issued = n = next(self._seq)
        return n

    def connect_shm(self, env: select.Overrides) -> bool:
        """Connect the group's shm transport on the first call (collective: every rank
        issues its first collective), and say whether this collective runs on it. Its
        waits enforce deadlines and fail fast themselves; elsewhere the watchdog
        watches (see watchdog.py)."""
        if env.transport == "torch" or env.algo == "native":
            return False
        t = self.transports
        shm = t.existing_shm() if t.has_shm_answer() else t.shm()
        return shm is not None

    def watch(self, entry: Entry, fut: torch.futures.Future,
              value: list[torch.Tensor]) -> torch.futures.Future:
        """A future that follows ``fut`` but fails at the deadline or when a peer is gone."""
        self.board.attach()
        return WATCHDOG.watch(entry, fut, self.timeout, self.board, self.rank,
                              self.world_size, value,
                              lambda exc: self.failures.watched(entry, exc), owner=self)

    def close(self, timeout: float = 10.0, abandon: str | None = None) -> None:
        """Finish or fail what is in flight, tell the peers (board, shm state), release all:
        the engine thread and the board's store helper are joined. With ``abandon`` (the
        process exits; the reason, in words) queued work fails at once and the collective
        in flight is aborted, see [Note: how a gradring process exits] in ``leaving.py``."""
        failed = self.failures.failed
        reason = abandon or "comm.shutdown() while the collective was in flight"
        if abandon is not None:
            self.engine.abandon(abandon)
            timeout = 0.0
        # After a failure the engine may sit in a gloo wait that nothing can interrupt
        # (its caller was already told): do not wait for it.
        self.engine.shutdown(min(timeout, 0.5) if failed else timeout)
        thread = self.engine.thread()
        if self.engine.alive():  # a collective is still blocked: make shm waits give up
            self.transports.abort(reason)
            if thread is None or thread.ident not in threads.stuck_idents():
                self.engine.join(2.0)
        WATCHDOG.cancel(self, reason)
        if not self.failures.failed:  # a failure stays on the board: peers must see why
            # "left after #k", or "left in #k+1" when it abandons #k+1 (and any later):
            # a peer waiting in #k+1 must stop, and not read that this rank skipped it.
            k = self.last_seq + (self.issued > self.last_seq)
            self.board.post("left", k, f"#{k}", ABANDONED if k > self.last_seq else "")
        self.board.stop()
        # Break the cycles through this context (its small path, its failures' progress
        # callback): once the registry lets go of it, it -- and the process group it
        # holds, with gloo's threads -- goes at once, not at some later collection or
        # while the interpreter finalizes (see [Note: how a gradring process exits]).
        self.small = None
        self.failures.progress = None
        if self.engine.alive():
            return  # still inside a collective (gloo wait): unmapping now could crash it
        self.transports.close()


def context(group: Any) -> GroupContext | None:
    """The context of ``group`` (default group for None); None if this rank is not in it."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    ctx = GROUPS.get(group)
    if ctx is None:
        _close_destroyed()
        ctx = GROUPS.get_or_make(group, GroupContext)
        root_cause.install()  # runs before the groups close at exit ([Note: torchrun's root cause])
        # Before any connect, which may run in another thread: see [Note: installing
        # the SIGTERM handler from the main thread] in transports/shm/sigterm.py.
        sigterm.install(live_transports)
        orphans.watch(live_transports, dist.get_rank())  # [Note: orphaned workers]
        _release_at_multiprocessing_exit()  # [Note: multiprocessing children skip atexit]
        # Outside the registry's lock: it waits for the peers' first call on the group.
        ctx.agree_settings()  # type: ignore[attr-defined]
    elif sigterm.deferred is not None:
        sigterm.install_deferred()
    return ctx  # type: ignore[return-value] # the registry holds GroupContexts only


def existing_context(group: Any) -> GroupContext | None:
    """The context of ``group`` if one was made already (None otherwise; never makes one)."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    return GROUPS.get(group)  # type: ignore[return-value]


def _close_destroyed() -> None:
    """Release the contexts of process groups torch has destroyed since."""
    try:
        live = dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - private API
        return
    for ctx in GROUPS.pop_missing(live):
        ctx.close(1.0)


def shutdown(group: Any = None, *, all_groups: bool = False, timeout: float = 10.0) -> None:
    """Tear down gradring's state for ``group`` (or every group): engine threads,
    transports, shared-memory segments. Collectives issued later start afresh."""
    if all_groups:
        victims = GROUPS.pop_all()
    else:
        if group is None and dist.is_initialized():
            group = dist.distributed_c10d._get_default_group()
        ctx = GROUPS.pop(group)
        victims = [ctx] if ctx else []
    for ctx in victims:
        ctx.close(timeout)
    if all_groups:
        WATCHDOG.stop()


def _forget_after_fork() -> None:
    """A forked child inherits contexts whose threads and peers are not its own:
    drop them without closing (closing would unlink the parent's segments); and a
    default group it must not destroy at exit."""
    global _inherited_default
    GROUPS.forget()
    with contextlib.suppress(Exception):
        _inherited_default = dist.distributed_c10d.GroupMember.WORLD


def _release_all() -> None:
    """What a multiprocessing child's exit finalizers release: the exit sequence of
    [Note: how a gradring process exits] (``leaving.py``), which its ``_bootstrap``
    runs again (a no-op then) from ``threading._shutdown``."""
    _exit_sequence()


def _release_at_exit() -> list[str]:
    """Steps 2-3 of [Note: how a gradring process exits] (``leaving.py``): abandon and close
    every group's state, stop the process's threads; returns the collectives gloo still
    runs for gradring (their futures were failed here)."""
    if leaving.debugging():
        _report_alive()
    native = WATCHDOG.pending()
    for ctx in GROUPS.pop_all():
        with contextlib.suppress(Exception):
            ctx.close(0.0, abandon="abandoned: this process is exiting")  # type: ignore[call-arg]
    for t in live_transports():  # one whose group's close returned early
        with contextlib.suppress(Exception):
            t.close()
    WATCHDOG.stop()
    HEARTBEAT.stop()
    orphans.stop()
    return native


def _report_alive() -> None:
    """``GRADRING_DEBUG=exit``: what of gradring is alive as the exit begins."""
    stuck = threads.stuck()
    for t in threads.live():
        where = stuck.get(t.name)
        leaving.say(f"thread {t.name} alive" + (f", in {where}" if where else ""))
    for ctx in GROUPS.values():
        leaving.say(f"group {ctx.name} (rank {ctx.rank} of {ctx.world_size}) alive, "  # type: ignore[attr-defined]
                    f"{ctx.engine.pending()} collectives queued or running")  # type: ignore[attr-defined]
    for e in RECORDER.entries():
        if e.state in ("issued", "started"):
            leaving.say(f"collective {e.describe()} pending ({e.state})")


#: In a forked child: the default group it inherited (None: none, or not forked).
_inherited_default: Any = None


def _destroy_default() -> None:
    """Step 4 of [Note: how a gradring process exits]: destroy what remains of torch's
    process groups (the default group and every group made after it). Never a group a
    forked child (a DataLoader worker) inherited: its gloo threads are the parent's."""
    if dist.is_available() and dist.is_initialized():
        default = dist.distributed_c10d.GroupMember.WORLD
        if default is not None and default is not _inherited_default:
            _torch_destroy()
    # A group the program destroyed (or the one above) still held in a reference cycle:
    # freed now, with its gloo threads, rather than while the interpreter finalizes.
    gc.collect()


def _exit_sequence() -> None:
    leaving.begin(_release_at_exit, _destroy_default)


#: torch's own ``destroy_process_group`` (wrapped below).
_torch_destroy = dist.destroy_process_group


@functools.wraps(_torch_destroy)
def destroy_process_group(group: Any = None) -> None:
    """torch's ``destroy_process_group``, after releasing gradring's state of the groups it
    destroys (``None``: the default group, and so every group): their engine threads and
    store helpers are joined and nothing of gradring keeps them alive. At exit, after
    gradring destroyed the default group (step 4 of [Note: how a gradring process
    exits]), a program's own call from ``atexit`` finds nothing left to do."""
    if threads.exiting.is_set() and group is None and not dist.is_initialized():
        return
    try:
        if group is None or group is dist.GroupMember.WORLD:
            victims = GROUPS.pop_all()
        else:
            victims = [c for c in [GROUPS.pop(group)] if c is not None]
    except Exception:  # noqa: BLE001 - torch's own call must still run
        victims = []
    for ctx in victims:
        with contextlib.suppress(Exception):
            ctx.close(10.0)
    if not GROUPS.values():
        WATCHDOG.stop()
        HEARTBEAT.stop()
    del victims
    _torch_destroy(group)
    # Whatever still holds the group in a reference cycle (a model's wrapper the program
    # dropped): collected now, so gloo's threads are joined before this returns.
    gc.collect()


dist.destroy_process_group = destroy_process_group
dist.distributed_c10d.destroy_process_group = destroy_process_group


#: The pid that registered :func:`_release_all` with multiprocessing's exit (0: none).
_mp_exit_hooked = 0


def _release_at_multiprocessing_exit() -> None:
    """In a ``multiprocessing`` child, run :func:`_release_all` at its exit too.

    [Note: multiprocessing children skip atexit]
    A forked ``multiprocessing.Process`` (torch's ``MultiProcessTestCase`` ranks)
    ends with ``os._exit``: ``atexit`` never runs there, so its segments stayed in
    /dev/shm until the next sweep. It does run multiprocessing's exit finalizers
    (``multiprocessing.util.Finalize``), cleared at its start, so one is
    registered here, once per child, with its first group context (a spawned
    child runs it too, before atexit, which then finds nothing left).
    """
    global _mp_exit_hooked
    if _mp_exit_hooked == os.getpid() or multiprocessing.parent_process() is None:
        return
    _mp_exit_hooked = os.getpid()
    multiprocessing.util.Finalize(None, _release_all, exitpriority=0)


# At exit, queued work gets a short grace period: a peer may already be gone.
atexit.register(shutdown, all_groups=True, timeout=2.0)
leaving.install(_exit_sequence)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
