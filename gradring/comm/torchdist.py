"""Point-to-point over a torch.distributed process group (ranks on different hosts).

``isend``/``irecv`` map to ``torch.distributed.isend``/``irecv`` on the group
(gloo for CPU tensors); gloo moves the bytes on its own threads, so a ring
round's pieces overlap with the reductions done in ``wait_all``. Only the
point-to-point interface is offered: ring and tree run here, direct does not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transport import CollectiveError, CollectiveInfo


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
        self._info: CollectiveInfo | None = None
        self._deadline = 0.0

    def start(self, info: CollectiveInfo) -> None:
        self._info = info
        self._deadline = time.monotonic() + self._timeout

    def close(self) -> None:
        self.group = None

    def _error(self, verb: str, peer: int, exc: BaseException) -> CollectiveError:
        desc = self._info.describe() if self._info else "collective"
        return CollectiveError(f"gradring {desc} failed on rank {self.rank}: could not {verb} "
                               f"rank {peer}: {exc}")

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        try:
            work = dist.isend(buf, group=self.group, group_dst=dst) if buf.numel() else None
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error("send to", dst, exc) from exc
        return _Req(work, buf, None, None, dst, "send to")

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        if not buf.numel():
            return _Req(None, buf, None, None, src, "receive from")
        tmp = torch.empty_like(buf) if op is not None else None
        try:
            work = dist.irecv(buf if tmp is None else tmp, group=self.group, group_src=src)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error("receive from", src, exc) from exc
        return _Req(work, buf, tmp, op, src, "receive from")

    def wait_all(self, reqs: Sequence[Any]) -> None:
        for req in reqs:
            if req.done:
                continue
            left = self._deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError(f"deadline of {self._timeout:g}s passed")
                req.work.wait(timedelta(seconds=left))
            except Exception as exc:  # noqa: BLE001 - re-raised with context
                raise self._error(req.verb, req.peer, exc) from exc
            if req.tmp is not None:
                ops.combine(req.buf, req.buf, req.tmp, req.op)
            req.done = True
