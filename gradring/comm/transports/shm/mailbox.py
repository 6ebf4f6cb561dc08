"""Point-to-point mailboxes of the shared-memory transport (for ring and tree).

Per receiving rank ``d``, each control segment holds a channel header (sent,
acked, slot lengths) and ``SLOTS`` slots of ``SLOT_BYTES`` (``layout.py``). A
sender copies fragments into free slots and bumps *sent*; the receiver copies
(or reduces) them out and bumps *acked*; both ring the other's doorbell.
:class:`Mailboxes`, owned by the transport, asks it through three callables
for what only it knows: whether a sender is in the same collective
(``check_sender``), the error for a malformed message (``fail``) and how to
wait for a word (``block``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gradring.comm import ops
from gradring.comm.ops import Op
from gradring.comm.transports.shm import futex
from gradring.comm.transports.shm.layout import (
    CHAN_ACKED,
    CHAN_LEN,
    CHAN_SENT,
    DOORBELL_WORD,
    SLOT_BYTES,
    SLOTS,
    chan_word,
    slots_offset,
)

_MASK = 0xFFFFFFFF


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

    def __init__(self, rank: int, ctls: Sequence[Any], *,
                 check_sender: Callable[[int, bool], None],
                 fail: Callable[[str, Sequence[int]], BaseException],
                 block: Callable[[int, int, Callable[[int], bool], str, Sequence[int]], None]
                 ) -> None:
        # This rank, and every rank's mapped control segment (this rank's own included).
        self.rank = rank
        self._ctls = list(ctls)
        # Their 32-bit word views, indexed [rank][word] in the hot loops.
        self._words = [c.words for c in self._ctls]
        # Byte offset of the first slot (equal in every control segment).
        self._slot_base = slots_offset(len(self._ctls))
        # The owner's checks and waits (see the module docstring).
        self._check_sender = check_sender
        self._fail = fail
        self._block = block
        # Pending transfers per peer, in posting order.
        self._sendq: dict[int, deque[_Send]] = {p: deque() for p in range(len(self._ctls))}
        self._recvq: dict[int, deque[_Recv]] = {p: deque() for p in range(len(self._ctls))}
        # The collective in flight (None before the first) and, per peer, the seq
        # whose first message was checked with ``check_sender``.
        self._seq: int | None = None
        self._checked = [-1] * len(self._ctls)

    def begin(self, seq: int) -> None:
        """A new collective starts: check each sender again before its first message."""
        self._seq = seq

    def close(self) -> None:
        """Drop the mappings (the owner unmaps them)."""
        self._ctls, self._words = [], []

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
        sent_w, acked_w = chan_word(dst, CHAN_SENT), chan_word(dst, CHAN_ACKED)
        sent = words[sent_w]
        moved = False
        mm_np = self._ctls[self.rank].array
        while req.off < len(req.data) and ((sent - words[acked_w]) & _MASK) < SLOTS:
            k = sent % SLOTS
            frag = min(SLOT_BYTES, len(req.data) - req.off)
            at = self._slot(dst, k)
            np.copyto(mm_np[at:at + frag], req.data[req.off:req.off + frag])
            words[chan_word(dst, CHAN_LEN + k)] = frag
            sent = (sent + 1) & _MASK
            words[sent_w] = sent
            req.off += frag
            moved = True
        if moved:
            futex.add_and_wake(self._ctls[dst].address + 4 * DOORBELL_WORD)
        req.done = req.off >= len(req.data)
        return moved

    def _pull(self, req: _Recv) -> bool:
        src = req.src
        words = self._words[src]
        sent_w, acked_w = chan_word(self.rank, CHAN_SENT), chan_word(self.rank, CHAN_ACKED)
        acked = words[acked_w]
        moved = False
        if words[sent_w] != acked and self._seq is not None \
                and self._checked[src] != self._seq:
            self._checked[src] = self._seq
            self._check_sender(src, False)
        while req.off < len(req.data) and words[sent_w] != acked:
            k = acked % SLOTS
            frag = words[chan_word(self.rank, CHAN_LEN + k)]
            want = min(SLOT_BYTES, len(req.data) - req.off)
            if frag != want:
                # Ranks issued different sizes: name both sides if the sender's status
                # shows it (a DesyncError), else fail as a broken peer.
                self._check_sender(src, True)
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
            futex.add_and_wake(self._ctls[src].address + 4 * DOORBELL_WORD)
        req.done = req.off >= len(req.data)
        return moved

    def _progress(self) -> bool:
        moved = False
        for queues, step in ((self._sendq, self._push), (self._recvq, self._pull)):
            for q in queues.values():
                while q:
                    moved |= step(q[0])  # type: ignore[operator]
                    if not q[0].done:
                        break
                    q.popleft()
        return moved

    def wait_all(self, reqs: Sequence[Any]) -> None:
        me = self.rank
        while True:
            bell = self._words[me][DOORBELL_WORD]
            moved = self._progress()
            if all(r.done for r in reqs):
                return
            if moved:
                continue
            peers = sorted({getattr(r, "dst", getattr(r, "src", -1)) for r in reqs if not r.done})
            self._block(me, DOORBELL_WORD, lambda v, b=bell: v != b,
                        "point-to-point messages", peers)
