"""Point-to-point over a torch.distributed process group (ranks on different hosts).

``isend``/``irecv`` map to ``torch.distributed.isend``/``irecv`` on the group
(gloo for CPU tensors, its threads moving the bytes while ``wait_all``
reduces). Only the point-to-point interface is offered: ring and tree run
here, direct does not. Every message is tagged from the collective's
fingerprint ([Note: desync checks]), so messages of two collectives never
match (nor make gloo abort on a message longer than its receive); with
``GRADRING_CHECK=1`` the fingerprint also goes ahead of the first message to
each peer. A gloo wait cannot be interrupted, so it runs to gradring's
deadline as a wait nothing can wake (``threads.uninterruptible``, [Note: how
a gradring process exits] in ``leaving.py``); failing the caller's future
early is the watchdog's job. After a failure the transport refuses further
work, and each instance uses its own tag, so a new one never receives what an
old one left in gloo.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import defaultdict
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm import desync, ops, peers
from gradring.comm.ops import Op
from gradring.comm.threads import uninterruptible
from gradring.comm.transport import Collective, CollectiveError

#: Per group name, the tag of the next transport instance (same order on every rank).
_tags: defaultdict[str, itertools.count] = defaultdict(itertools.count)


class _Req:
    __slots__ = ("work", "buf", "tmp", "op", "peer", "verb", "done")

    def __init__(self, work: Any, buf: torch.Tensor, tmp: torch.Tensor | None,
                 op: Op | None, peer: int, verb: str) -> None:
        self.work = work  # torch Work, None for empty messages
        self.buf = buf  # user-visible buffer
        self.tmp = tmp  # receive buffer when reducing on arrival
        self.op = op  # reduction applied as buf = buf (op) tmp
        self.peer = peer  # the other group rank
        self.verb = verb  # "send to" / "receive from", for errors
        self.done = work is None


class TorchTransport:
    """Messages through ``group``'s own send/recv."""

    name = "torch"

    def __init__(self, group: Any, rank: int, world_size: int, timeout: float) -> None:
        # The process group carrying the bytes.
        self.group = group
        # Group rank and size.
        self.rank = rank
        self.world_size = world_size
        # Seconds a collective may take.
        self._timeout = timeout
        # The collective in flight and its deadline, for errors.
        self._info: Collective | None = None
        self._deadline = 0.0
        # This collective's fingerprint; sent ahead of the data with GRADRING_CHECK.
        self._fp = torch.zeros(desync.WORDS, dtype=torch.int64)
        self._full_check = False
        # The tag of this collective's messages (instance and fingerprint).
        self._msg_tag = 0
        # Peers that already got our fingerprint in this collective (and its sends).
        self._fp_sent: dict[int, Any] = {}
        # Per peer: the receive of its fingerprint and the buffer it lands in.
        self._gates: dict[int, tuple[Any, torch.Tensor]] = {}
        # Peers whose fingerprint matched in this collective.
        self._checked: set[int] = set()
        # Message tag of this instance (see the module docstring).
        self._tag = next(_tags[str(getattr(group, "group_name", ""))])
        # Set after a failure: every later call fails.
        self._broken: str | None = None

    def start(self, info: Collective) -> None:
        if self._broken is not None:
            raise CollectiveError(f"gradring {info.describe()}: the torch transport is unusable "
                                  f"after an earlier failure ({self._broken})")
        self._info = info
        self._deadline = time.monotonic() + self._timeout
        self._full_check = desync.enabled()
        self._fp = desync.fingerprint(info, full=self._full_check)  # fresh: sends may be in flight
        self._msg_tag = desync.tag_of(self._tag, self._fp)
        self._fp_sent = {}
        self._gates = {}
        self._checked = set()

    def close(self) -> None:
        self.group = None

    def _error(self, verb: str, peer: int, exc: BaseException) -> CollectiveError:
        desc = self._info.describe() if self._info else "collective"
        self._broken = f"could not {verb} rank {peer}"
        note = ""
        if "closed" in str(exc).lower() and self.group is not None:
            # gloo names no one: say which peer on this host has exited, and how.
            with contextlib.suppress(Exception):
                found = peers.explain(self.group, None, desc)
                note = f" ({found})" if found and "has exited" in found else ""
        return CollectiveError(f"gradring {desc} failed on rank {self.rank}: could not {verb} "
                               f"rank {peer}{note}: {exc}")

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        if not buf.numel():
            return _Req(None, buf, None, None, dst, "send to")
        tag = self._msg_tag
        try:
            if self._full_check and dst not in self._fp_sent:
                self._fp_sent[dst] = dist.isend(self._fp, group=self.group, group_dst=dst,
                                                tag=tag)
            work = dist.isend(buf, group=self.group, group_dst=dst, tag=tag)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error("send to", dst, exc) from exc
        return _Req(work, buf, None, None, dst, "send to")

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        if not buf.numel():
            return _Req(None, buf, None, None, src, "receive from")
        tmp = torch.empty_like(buf) if op is not None else None
        tag = self._msg_tag
        try:
            if self._full_check and src not in self._checked and src not in self._gates:
                theirs = torch.empty(desync.WORDS, dtype=torch.int64)
                self._gates[src] = (dist.irecv(theirs, group=self.group, group_src=src,
                                               tag=tag), theirs)
            work = dist.irecv(buf if tmp is None else tmp, group=self.group, group_src=src,
                              tag=tag)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error("receive from", src, exc) from exc
        return _Req(work, buf, tmp, op, src, "receive from")

    def _wait(self, work: Any, verb: str, peer: int) -> None:
        left = self._deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError(f"deadline of {self._timeout:g}s passed")
            with uninterruptible(f"a gloo wait to {verb} rank {peer}"):
                work.wait(timedelta(seconds=left))
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(verb, peer, exc) from exc

    def _check_peer(self, src: int) -> None:
        """Wait for ``src``'s fingerprint and compare it with ours."""
        work, theirs = self._gates.pop(src)
        self._wait(work, "receive from", src)
        mine = self._fp.tolist()
        what = desync.difference(mine, theirs.tolist())
        if what is not None:
            assert self._info is not None
            err = desync.mismatch(self._info, self.rank, src, theirs.tolist(), what)
            self._broken = str(err)
            raise err
        self._checked.add(src)

    def wait_all(self, reqs: Sequence[Any]) -> None:
        for req in reqs:
            if req.done:
                continue
            if req.peer in self._gates and req.verb == "receive from":
                self._check_peer(req.peer)  # before its data is consumed or combined
            self._wait(req.work, req.verb, req.peer)
            if req.tmp is not None:
                ops.combine(req.buf, req.buf, req.tmp, req.op)
            req.done = True
