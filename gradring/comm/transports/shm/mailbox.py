"""Point-to-point mailboxes of the shared-memory transport (for ring and tree).

Each rank's control segment (layout in ``shm.py``) holds, per receiving rank
``d``, a channel header at ``CHAN_OFF + CHAN_STRIDE·d`` (words: 0 sent, 16
acked, 32+k length of slot k) and ``SLOTS`` slots of ``SLOT_BYTES`` in the
page-aligned area after the headers. A sender copies fragments into free
slots and bumps *sent*; the receiver copies (or reduces) them out and bumps
*acked*; both ring the other's doorbell. The direct algorithms (``direct.py``)
do not use any of this: they read exposed buffers.

``Mailboxes`` is mixed into ``ShmTransport``, whose mappings (``_words``,
``_ctls``), failure reporting (``_fail``, ``_check_sender``) and waits
(``_block``) it uses.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transports.shm import futex

_DOORBELL_WORD = 128 // 4
_CHAN_OFF = 640
_CHAN_STRIDE = 192  # sent, acked and lengths on separate cache lines
_MASK = 0xFFFFFFFF

#: Mailbox geometry: slots per (sender, receiver) pair and bytes per slot.
SLOTS = 4
SLOT_BYTES = 256 * 1024


class _Send:
    __slots__ = ("data", "dst", "off", "done")

    def __init__(self, data: np.ndarray, dst: int) -> None:
        self.data = data  # bytes to send
        self.dst = dst  # receiving rank
        self.off = 0  # bytes already placed in slots
        self.done = not len(data)  # empty messages complete at once


class _Recv:
    __slots__ = ("buf", "data", "src", "op", "off", "done")

    def __init__(self, buf: torch.Tensor, src: int, op: Op | None) -> None:
        self.buf = buf  # typed destination (used when reducing)
        self.data = buf.view(torch.uint8).numpy() if buf.numel() else np.empty(0, np.uint8)
        self.src = src  # sending rank
        self.op = op  # None: overwrite; else buf = buf (op) incoming
        self.off = 0  # bytes already consumed
        self.done = not len(self.data)


class Mailboxes:
    """isend/irecv/wait_all over the control segments' mailbox slots."""

    _words: Any
    _ctl: Any
    _ctls: Any
    _slot_base: int
    _sendq: dict[int, Any]
    _recvq: dict[int, Any]
    _info: Any
    _checked: list[int]
    rank: int

    def _chan_word(self, dst: int, which: int) -> int:
        """Word index in the *sender's* control segment: 0 sent, 16 acked, 32+k length k."""
        return (_CHAN_OFF + _CHAN_STRIDE * dst) // 4 + which

    def _slot(self, dst: int, k: int) -> int:
        """Byte offset, in the sender's control segment, of slot ``k`` towards ``dst``."""
        return self._slot_base + (dst * SLOTS + k) * SLOT_BYTES

    def isend(self, buf: torch.Tensor, dst: int) -> Any:
        req = _Send(buf.view(torch.uint8).numpy() if buf.numel() else np.empty(0, np.uint8), dst)
        if not req.done:
            self._sendq[dst].append(req)
        return req

    def irecv(self, buf: torch.Tensor, src: int, op: Op | None = None) -> Any:
        req = _Recv(buf, src, op)
        if not req.done:
            self._recvq[src].append(req)
        return req

    def _push(self, req: _Send) -> bool:
        words, dst = self._words[self.rank], req.dst
        sent_w, acked_w = self._chan_word(dst, 0), self._chan_word(dst, 16)
        sent = words[sent_w]
        moved = False
        mm_np = self._ctl.array
        while req.off < len(req.data) and ((sent - words[acked_w]) & _MASK) < SLOTS:
            k = sent % SLOTS
            frag = min(SLOT_BYTES, len(req.data) - req.off)
            at = self._slot(dst, k)
            np.copyto(mm_np[at:at + frag], req.data[req.off:req.off + frag])
            words[self._chan_word(dst, 32 + k)] = frag
            sent = (sent + 1) & _MASK
            words[sent_w] = sent
            req.off += frag
            moved = True
        if moved:
            futex.add_and_wake(self._ctls[dst].address + 4 * _DOORBELL_WORD)
        req.done = req.off >= len(req.data)
        return moved

    def _pull(self, req: _Recv) -> bool:
        src = req.src
        words = self._words[src]
        sent_w, acked_w = self._chan_word(self.rank, 0), self._chan_word(self.rank, 16)
        acked = words[acked_w]
        moved = False
        if words[sent_w] != acked and self._info is not None \
                and self._checked[src] != self._info.seq:
            self._check_sender(src)
        while req.off < len(req.data) and words[sent_w] != acked:
            k = acked % SLOTS
            frag = words[self._chan_word(self.rank, 32 + k)]
            want = min(SLOT_BYTES, len(req.data) - req.off)
            if frag != want:
                raise self._fail(f"message size mismatch: got a {frag}-byte fragment, "
                                 f"expected {want}", [src])
            at = self._slot(self.rank, k)
            if req.op is None:
                np.copyto(req.data[req.off:req.off + frag], self._ctls[src].array[at:at + frag])
            else:
                size = req.buf.element_size()
                dst = req.buf[req.off // size:(req.off + frag) // size]
                ops.combine(dst, dst, self._ctls[src].view(at, frag, req.buf.dtype), req.op)
            acked = (acked + 1) & _MASK
            words[acked_w] = acked
            req.off += frag
            moved = True
        if moved:
            futex.add_and_wake(self._ctls[src].address + 4 * _DOORBELL_WORD)
        req.done = req.off >= len(req.data)
        return moved

    def _progress(self) -> bool:
        moved = False
        for queues, step in ((self._sendq, self._push), (self._recvq, self._pull)):
            for q in queues.values():
                while q:
                    moved |= step(q[0])
                    if not q[0].done:
                        break
                    q.popleft()
        return moved

    def wait_all(self, reqs: Sequence[Any]) -> None:
        me = self.rank
        while True:
            bell = self._words[me][_DOORBELL_WORD]
            moved = self._progress()
            if all(r.done for r in reqs):
                return
            if moved:
                continue
            peers = sorted({getattr(r, "dst", getattr(r, "src", -1)) for r in reqs if not r.done})
            self._block(me, _DOORBELL_WORD, lambda v, b=bell: v != b,
                        "point-to-point messages", peers)



def slots_offset(world_size: int) -> int:
    """Byte offset of the first mailbox slot in a control segment."""
    end = _CHAN_OFF + _CHAN_STRIDE * world_size
    return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE


def control_size(world_size: int) -> int:
    """Bytes of one rank's control segment, mailbox slots included."""
    return slots_offset(world_size) + world_size * SLOTS * SLOT_BYTES
