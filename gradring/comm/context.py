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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradring.comm import direct, engine, hierarchical, rendezvous, ring, select, shm, tree
from gradring.comm.ops import Op
from gradring.comm.torchdist import TorchTransport
from gradring.comm.transport import CollectiveInfo, Kind, Transport

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

    def next_seq(self) -> int:
        return next(self._seq)

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
                self._transports["torch"] = TorchTransport(
                    self.group, self.rank, self.world_size, self.timeout)
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
        kind_name, transport = self.pick_transport(plan.env.transport)
        nbytes = inp.numel() * inp.element_size()
        choice = select.choose(plan.kind, nbytes, self.world_size, kind_name, plan.env.algo)
        info = CollectiveInfo(plan.seq, plan.kind, nbytes, inp.dtype,
                              f"{choice.algo} over {choice.transport}", self.name)
        transport.start(info)
        _dispatch(transport, info, choice.algo, plan, out, inp)
        if copy_back:
            plan.output.copy_(out.view(plan.output.shape))

    def close(self, timeout: float = 10.0) -> None:
        self.engine.shutdown(timeout)
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
    if algo == "hierarchical":
        hierarchical.all_reduce(t, info, out, plan.op)
    elif algo.startswith("direct"):
        if kind == Kind.ALL_REDUCE:
            if algo == "direct/oneshot":
                direct.all_reduce_oneshot(t, info, out, plan.op)
            else:
                direct.all_reduce_twoshot(t, info, out, plan.op)
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
        with _contexts_lock:
            ctx = _contexts.get(group)
            if ctx is None:
                ctx = _contexts[group] = GroupContext(group)
    return ctx


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


def _forget_after_fork() -> None:
    """A forked child inherits contexts whose threads and peers are not its own:
    drop them without closing (closing would unlink the parent's segments)."""
    _contexts.clear()


# At exit, queued work gets a short grace period: a peer may already be gone.
atexit.register(shutdown, all_groups=True, timeout=2.0)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
