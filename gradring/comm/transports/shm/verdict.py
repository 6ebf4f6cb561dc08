"""A group's failure is sticky: the verdict word and the lock that guards it.

[Note: sticky failures]
A rank that gives up on a collective must not leave a peer that completes it:
the peer would return success for a collective the first rank failed, or (zero
copy) keep writing into the tensor of a rank that returned. So the group keeps
one *verdict* in rank 0's control segment (``layout.VERDICT_WORD``), "rank r
failed #k first", set once and never cleared. Arriving at a barrier and
deciding to fail exclude each other under a file lock (``flock``) on rank 0's
control segment: a rank arrives only under the lock and only with no verdict
set; a rank fails only under the lock, after re-checking that not everybody
arrived after all. So nobody passes a barrier someone gave up on, and once
everybody passed nobody fails it; every direct collective ends with such a
barrier (the closing agreement, ``ShmTransport.finish``). The kernel drops a
dead holder's lock; a lock held past the deadline counts as a timeout that
names the holder (``layout.LOCK_HOLDER_WORD``) and whether it is stopped. The
failing rank writes its reason in words into its own segment
(``layout.REASON_OFF``) for the peers' errors.
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from gradring.comm.transports.shm.layout import (
    LOCK_HOLDER_WORD,
    REASON_BYTES,
    REASON_OFF,
    VERDICT_WORD,
)

_MASK = 0xFFFFFFFF


class GroupLock:
    """``flock`` on rank 0's control segment, with a deadline (never blocks forever)."""

    def __init__(self, fd: int, leader_words: Any = None, rank: int = -1) -> None:
        self._fd = fd
        self._held = 0
        # Rank 0's words (the holder word lives there) and this rank, to record the holder.
        self._leader = leader_words
        self._rank = rank

    def holder(self) -> int:
        """The rank that holds the lock as far as the holder word says (-1: nobody)."""
        return self._leader[LOCK_HOLDER_WORD] - 1 if self._leader is not None else -1

    def acquire(self, deadline: float) -> bool:
        """Take the lock (re-entrant); False if it was still held by another rank at
        ``deadline`` (``time.monotonic``)."""
        if self._held:
            self._held += 1
            return True
        tries = 0
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._held = 1
                if self._leader is not None:
                    self._leader[LOCK_HOLDER_WORD] = self._rank + 1
                return True
            except BlockingIOError:
                pass
            tries += 1
            if tries < 64:
                continue  # held for a few µs by a running peer: retry at once
            if tries < 256:
                os.sched_yield()  # its holder may have been descheduled
                continue
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)

    def release(self) -> None:
        self._held -= 1
        if self._held == 0:
            if self._leader is not None:
                self._leader[LOCK_HOLDER_WORD] = 0
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def read(leader_words: Any) -> tuple[int, int] | None:
    """``(rank, seq low 32 bits)`` of the group's first failure, or None."""
    who = leader_words[VERDICT_WORD]
    return (who - 1, leader_words[VERDICT_WORD + 1]) if who else None


def set_first(leader_words: Any, rank: int, seq: int) -> None:
    """Record ``rank`` failing ``seq`` unless a failure is recorded already (under the lock)."""
    if not leader_words[VERDICT_WORD]:
        leader_words[VERDICT_WORD + 1] = seq & _MASK
        leader_words[VERDICT_WORD] = rank + 1


def write_reason(mm: Any, text: str) -> None:
    """This rank's failure in words, into its own control segment (truncated)."""
    data = text.encode("utf-8", "replace")[:REASON_BYTES - 4]
    mm[REASON_OFF + 4:REASON_OFF + 4 + len(data)] = data
    mm[REASON_OFF:REASON_OFF + 4] = len(data).to_bytes(4, "little")


def read_reason(mm: Any) -> str:
    """What a peer wrote with :func:`write_reason` ("" if nothing)."""
    n = min(int.from_bytes(mm[REASON_OFF:REASON_OFF + 4], "little"), REASON_BYTES - 4)
    return bytes(mm[REASON_OFF + 4:REASON_OFF + 4 + n]).decode("utf-8", "replace")
