"""Per-process-group state: transports, engine, sequence numbers; running one collective.

A :class:`GroupContext` is created on a group's first gradring call and lives
until ``comm.shutdown()`` (or exit). Creating the shm
transport is a rendezvous through the group's store, so the first gradring
call on a group (a collective or ``comm.empty``) must be made by every rank.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradring.comm import desync, engine, homes, select, watchdog
from gradring.comm.algos import direct, hierarchical, ring, tree
from gradring.comm.homes import Homes
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, CollectiveInfo, Kind, Transport
from gradring.comm.transports.shm import rendezvous
from gradring.comm.transports.shm import transport as shm
from gradring.comm.transports.torchdist import TorchTransport

#: torch's default for non-NCCL groups, used when the group's timeout is unknown.
DEFAULT_TIMEOUT_S = 1800.0


class Plan(NamedTuple):
    """One issued collective, as the engine runs it."""

    kind: Kind
    output: torch.Tensor  # written (all_reduce/broadcast: the tensor itself)
    input: torch.Tensor  # read (same object as output for in-place collectives)
    op: Op  # reduction (SUM for copies)
    root: int  # broadcast source, as a group rank
    seq: int  # issue number within the group, identical on every rank
    env: select.Overrides  # GRADRING_TRANSPORT / GRADRING_ALGO at issue time
    entry: watchdog.Entry | None = None  # its flight-recorder entry
    homes: Homes | None = None  # all_reduce only: see [Note: homed all-reduce]


def _group_timeout(group: Any) -> float:
    override = select.env_timeout()
    if override is not None:
        return override
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return DEFAULT_TIMEOUT_S


def _group_store(group: Any) -> Any:
    """A store private to ``group``: its own prefixed store, else a prefix of the default."""
    try:
        return dist.distributed_c10d._world.pg_map[group][1]
    except Exception:  # noqa: BLE001 - private API
        ranks = "-".join(map(str, dist.get_process_group_ranks(group)))
        return dist.PrefixStore(f"gradring/{group.group_name}/{ranks}/",
                                dist.distributed_c10d._get_default_store())


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
        # Transports made so far ("shm" maps to None when unavailable).
        self._transports: dict[str, Transport | None] = {}
        # Why shm is unavailable (for the error when it is forced).
        self._shm_reason = ""
        # Why the multi-host transports are unavailable ("hosts" maps to None then).
        self._hosts_reason = ""
        # Serialises transport creation between the engine and callers of empty().
        self._lock = threading.Lock()
        # Fail-fast markers in the group's store, attached by the first watched collective.
        self.board = watchdog.PeerBoard(_group_store(group), self.rank, self.world_size)
        # Last sequence number this rank issued and completed (the board's "left after").
        self.last_seq = 0
        # Set when the watchdog failed a collective the engine is still blocked in:
        # later collectives fail at once instead of queueing behind it.
        self.broken: str | None = None
        # Whether a collective of this group failed here (then no "left" marker at close).
        self.failed = False
        watchdog.recorder.note_group(self.name, self.rank, self.world_size)

    def next_seq(self) -> int:
        return next(self._seq)

    def self_enforced(self, env: select.Overrides) -> bool:
        """Whether the transport enforces deadlines and fail-fast in the waiting thread
        (shm on one host); otherwise the watchdog watches (see watchdog.py). The first
        call connects shm (collective: every rank issues its first collective)."""
        if env.transport == "torch" or env.algo == "native":
            return False
        if "shm" not in self._transports:
            self.shm()
        return self._transports.get("shm") is not None

    def watch(self, entry: watchdog.Entry, fut: torch.futures.Future,
              value: list[torch.Tensor]) -> torch.futures.Future:
        """A future that follows ``fut`` but fails at the deadline or when a peer is gone."""
        self.board.attach()
        return watchdog.watchdog.watch(entry, fut, self.timeout, self.board, self.rank,
                                       self.world_size, value,
                                       lambda exc: self.watched_error(entry, exc), owner=self)

    def watched_error(self, entry: watchdog.Entry, exc: BaseException) -> BaseException:
        """The error a watched collective fails with (gloo's, or the watchdog's verdict)."""
        if isinstance(exc, CollectiveError):
            return exc  # run() already recorded it
        cls = desync.DesyncError if getattr(exc, "peer_error", "") == "DesyncError" \
            else CollectiveError
        err = cls(f"gradring {entry.describe()} failed on rank {self.rank} "
                  f"(group {self.name}, algo {entry.algo}): {exc}")
        if not isinstance(exc, watchdog.WatchdogError):  # its verdict came from the board
            err = self.with_board(err)
        if isinstance(exc, watchdog.WatchdogError):
            self.broken = str(err)
        self.record_failure(entry, err)
        return err

    def with_board(self, err: CollectiveError) -> CollectiveError:
        """``err`` plus what peers posted about their own failure or departure: a gloo
        error only names the neighbour, whose own failure may have named the culprit."""
        dead = self.board.dead_peers()
        for _ in range(3):  # a closed socket may show before the process is reaped
            if dead:
                break
            time.sleep(0.05)
            dead = self.board.dead_peers()
        if dead:
            err = type(err)(f"{err}; " + "; ".join(f"rank {p} (pid {pid}) has exited"
                                                    for p, pid in dead))
        told = {p: s for p, s in self.board.read().items() if s["state"] in ("failed", "left")}
        if not told:
            return err
        cls = desync.DesyncError if any(s.get("error") == "DesyncError"
                                        for s in told.values()) else type(err)
        return cls(f"{err}; the peers' own reports: " + "; ".join(
            watchdog.describe_status(p, s).splitlines()[0][:300]
            for p, s in sorted(told.items())))

    def record_failure(self, entry: watchdog.Entry | None, err: BaseException) -> None:
        """Flight recorder, board, dump: what every failure of this group goes through."""
        self.failed = True
        if entry is not None:
            entry.fail(str(err))
            self.board.post("failed", entry.seq, entry.describe(), str(err),
                            type(err).__name__)
        watchdog.recorder.dump(f"group {self.name}: {err}")

    def shm(self) -> shm.ShmTransport | None:
        """The shared-memory transport, connecting on first use (collective)."""
        with self._lock:
            if "shm" not in self._transports:
                t, why = rendezvous.connect(_group_store(self.group), self.rank, self.world_size,
                                     self.timeout)
                self._transports["shm"], self._shm_reason = t, why
            return self._transports["shm"]  # type: ignore[return-value]

    def existing_shm(self) -> shm.ShmTransport | None:
        """The shared-memory transport if it is already connected (no rendezvous)."""
        return self._transports.get("shm")  # type: ignore[return-value]

    def hosts(self) -> hierarchical.HostTransports | None:
        """Shared memory per host plus point-to-point across hosts, connecting on
        first use (collective); None unless several hosts with equal rank counts > 1."""
        if "hosts" in self._transports:  # every collective asks: skip the locks
            return self._transports["hosts"]  # type: ignore[return-value]
        flat = self.torch_transport()
        with self._lock:
            if "hosts" not in self._transports:
                t, why = hierarchical.connect(_group_store(self.group), self.rank,
                                              self.world_size, self.timeout, flat)
                self._transports["hosts"], self._hosts_reason = t, why
            return self._transports["hosts"]  # type: ignore[return-value]

    def existing_hosts(self) -> hierarchical.HostTransports | None:
        """The multi-host transports if already connected (no rendezvous)."""
        return self._transports.get("hosts")  # type: ignore[return-value]

    def torch_transport(self) -> Transport:
        with self._lock:
            if "torch" not in self._transports:
                # A little past the deadline: the watchdog, which names who arrived,
                # speaks first; gloo's own timeout is the backstop.
                self._transports["torch"] = TorchTransport(
                    self.group, self.rank, self.world_size,
                    self.timeout + 2 * watchdog.POLL_S + 0.5)
            return self._transports["torch"]  # type: ignore[return-value]

    def pick_transport(self, forced: str | None) -> tuple[str, Transport]:
        if forced != "torch":
            t = self.shm()
            if t is not None:
                return "shm", t
            if forced == "shm":
                raise RuntimeError(f"GRADRING_TRANSPORT=shm but shared memory is unavailable "
                                   f"for group {self.name}: {self._shm_reason}")
            hosts = self.hosts()
            if hosts is not None:
                return select.HOSTS, hosts
        return "torch", self.torch_transport()

    def run(self, plan: Plan) -> None:
        """Run one collective on the calling thread (engine or inline)."""
        out, copy_back = _flat(plan.output)
        inp = out if plan.input is plan.output else _flat(plan.input)[0]
        entry = plan.entry
        kind_name = "?"
        try:
            kind_name, transport = self.pick_transport(plan.env.transport)
            nbytes = inp.numel() * inp.element_size()
            choice = select.choose(plan.kind, nbytes, self.world_size, kind_name, plan.env.algo)
            info = CollectiveInfo(plan.seq, plan.kind, nbytes, inp.dtype,
                                  f"{choice.algo} over {choice.transport}", self.name,
                                  tuple(plan.input.shape), entry.label if entry else None)
            if entry is not None:
                entry.start(info.algo)
            transport.start(info)
            _dispatch(transport, info, choice.algo, plan, out, inp)
        except desync.DesyncError as exc:
            raise self.desync_error(entry, exc) from None
        except CollectiveError as exc:
            err = exc if kind_name == "shm" else self.with_board(exc)
            self.record_failure(entry, err)
            if err is exc:
                raise
            raise err from exc
        except BaseException as exc:
            self.record_failure(entry, exc)
            raise
        if copy_back:
            plan.output.copy_(out.view(plan.output.shape))
        if entry is not None:
            entry.finish()
        self.last_seq = plan.seq

    def desync_error(self, entry: watchdog.Entry | None,
                      exc: desync.DesyncError) -> desync.DesyncError:
        """Add what the other ranks say they issued (they post it too), then record."""
        self.record_failure(entry, exc)
        seq = entry.seq if entry else -1
        deadline = time.monotonic() + 1.0
        while True:
            others = {p: s for p, s in self.board.read().items()
                      if s["state"] == "failed" and s["seq"] == seq}
            if len(others) == self.world_size - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        said = "; ".join(f"rank {p} issued {s['what']}" for p, s in sorted(others.items()))
        err = desync.DesyncError(f"{exc}" + (f". Their own words: {said}" if said else ""))
        if entry is not None:
            entry.error = str(err)
        return err

    def close(self, timeout: float = 10.0) -> None:
        """Finish or fail what is in flight, tell the peers (board, shm state), release all."""
        # After a failure the engine may sit in a gloo wait that nothing can interrupt
        # (its caller was already told): do not wait for it.
        self.engine.shutdown(min(timeout, 0.5) if self.failed else timeout)
        reason = "comm.shutdown() while the collective was in flight"
        if self.engine.alive():  # a collective is still blocked: make shm waits give up
            for t in list(self._transports.values()):
                if t is not None and hasattr(t, "abort"):
                    t.abort(reason)
            self.engine.join(2.0)
        watchdog.watchdog.cancel(self, reason)
        if not self.failed:  # a failure stays on the board: peers must see why
            self.board.post("left", self.last_seq, f"#{self.last_seq}")
        if self.engine.alive():
            return  # still inside a collective (gloo wait): unmapping now could crash it
        with self._lock:
            for t in self._transports.values():
                if t is not None:
                    t.close()
            self._transports.clear()


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A flat contiguous view of ``t``, or a contiguous copy (then copy back after)."""
    if t.is_contiguous():
        return t.view(-1), False
    return t.contiguous().view(-1), True


def _dispatch(t: Any, info: CollectiveInfo, algo: str, plan: Plan, out: torch.Tensor,
              inp: torch.Tensor) -> None:
    kind = plan.kind
    if plan.homes is not None and algo != "direct/twoshot":
        # Only the two-shot reads homes itself; around anything else, stage them.
        own = homes.own_range(out.numel(), t.rank, t.world_size)
        homes.stage_in(out, plan.homes, *own)
        _dispatch(t, info, algo, plan._replace(homes=None), out, inp)
        homes.finish_out(out, plan.homes)
        return
    if algo == "hierarchical":
        hierarchical.all_reduce(t, info, out, plan.op)
    elif algo.startswith("direct"):
        if kind == Kind.ALL_REDUCE:
            if algo == "direct/oneshot":
                direct.all_reduce_oneshot(t, info, out, plan.op)
            else:
                direct.all_reduce_twoshot(t, info, out, plan.op, plan.homes)
        elif kind == Kind.BROADCAST:
            direct.broadcast(t, info, out, plan.root)
        elif kind == Kind.ALL_GATHER:
            direct.all_gather(t, info, out, inp)
        elif kind == Kind.REDUCE_SCATTER:
            direct.reduce_scatter(t, info, out, inp, plan.op)
        else:
            direct.barrier(t, info)
    elif kind == Kind.ALL_REDUCE:
        (tree.all_reduce if algo == "tree" else ring.all_reduce)(t, out, plan.op)
    elif kind == Kind.BROADCAST:
        tree.broadcast(t, out, plan.root)
    elif kind == Kind.ALL_GATHER:
        ring.all_gather(t, out, inp)
    elif kind == Kind.REDUCE_SCATTER:
        ring.reduce_scatter(t, out, inp, plan.op)
    else:
        tree.barrier(t)


_contexts: dict[Any, GroupContext] = {}
_contexts_lock = threading.Lock()


def context(group: Any) -> GroupContext | None:
    """The context of ``group`` (default group for None); None if this rank is not in it."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    ctx = _contexts.get(group)
    if ctx is None:
        _close_destroyed()
        with _contexts_lock:
            ctx = _contexts.get(group)
            if ctx is None:
                ctx = _contexts[group] = GroupContext(group)
    return ctx


def _close_destroyed() -> None:
    """Release the contexts of process groups torch has destroyed since."""
    try:
        live = dist.distributed_c10d._world.pg_map
    except Exception:  # noqa: BLE001 - private API
        return
    with _contexts_lock:
        dead = [g for g in _contexts if g not in live]
        victims = [_contexts.pop(g) for g in dead]
    for ctx in victims:
        ctx.close(1.0)


def shutdown(group: Any = None, *, all_groups: bool = False, timeout: float = 10.0) -> None:
    """Tear down gradring's state for ``group`` (or every group): engine threads,
    transports, shared-memory segments. Collectives issued later start afresh."""
    with _contexts_lock:
        if all_groups:
            victims = list(_contexts.values())
            _contexts.clear()
        else:
            if group is None and dist.is_initialized():
                group = dist.distributed_c10d._get_default_group()
            ctx = _contexts.pop(group, None)
            victims = [ctx] if ctx else []
    for ctx in victims:
        ctx.close(timeout)
    if all_groups:
        watchdog.watchdog.stop()


def _forget_after_fork() -> None:
    """A forked child inherits contexts whose threads and peers are not its own:
    drop them without closing (closing would unlink the parent's segments)."""
    _contexts.clear()


# At exit, queued work gets a short grace period: a peer may already be gone.
atexit.register(shutdown, all_groups=True, timeout=2.0)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
